"""Long-tailed GRPO rollouts for the TRL scenarios ``grpo_long`` and ``grpo_long_nogather``, and what they record.

A tiny random model never ends a completion on its own, so the length of each completion is decided here:
a logits processor, added to the policy's ``generate`` on its instance, stands in for a real model's EOS. It
forbids EOS until the completion's length is reached and forces it then. Lengths are long-tailed (Pareto
with shape 1 from 4 tokens, capped at 64: P(length >= k) = 4 / k, mean about 15) and come from a hash of the
row's prompt tokens and its row number, so they differ per completion and per rank, and are the same on
every route (the same data gives the same lengths, and sampling is the only other random draw).

Per rank and per optimizer step the scenario records (:class:`Rollouts`):

* ``generate_s``: seconds inside the policy's ``generate`` (the decoding itself);
* ``rollout_s``: seconds in TRL's generation phase (``GRPOTrainer._generate``: parameters gathered when
  ``ds3_gather_for_generation``, ``generate``, and TRL's all-gathers of the completion lengths right after
  it, where every rank meets the slowest);
* ``step_s``: the whole optimizer step (``on_step_begin`` to ``on_step_end``: rollouts, scoring, every
  micro-batch's forward and backward, the optimizer step);
* ``forwards``: the policy's forwards inside ``generate`` (transformers' dummy ones under ``synced_gpus``
  included);
* ``longest``: the longest completion this rank generated, in tokens (EOS included).

On ODC ``generate`` runs unsynced, so each rank runs as many forwards as its own longest completion; on
ZeRO-3 transformers keeps every rank in step (``synced_gpus``), so each runs as many as the longest on any
rank. :func:`check_forwards` holds the run to that, so the framework suite fails a route that does not.
"""
from __future__ import annotations

import time
import zlib

SHORTEST, LONGEST = 4, 64  # completion lengths in tokens, EOS included


def completion_length(prompt_tokens: list, row: int) -> int:
    """The length of row ``row``'s completion: Pareto (shape 1) from SHORTEST, capped at LONGEST."""
    digest = zlib.crc32(repr((list(prompt_tokens), row)).encode())
    uniform = ((digest % 65536) + 0.5) / 65536
    return min(LONGEST, int(SHORTEST / uniform))


def _long_tail_processor(pad_id: int, eos_id: int):
    """A ``LogitsProcessor`` that ends each row at its :func:`completion_length` (made when first called: the
    prompt is what ``input_ids`` holds then)."""
    import torch
    from transformers import LogitsProcessor

    class LongTail(LogitsProcessor):
        def __init__(self):
            self.prompt_len = None
            self.lengths: list = []

        def __call__(self, input_ids, scores):
            if self.prompt_len is None:
                self.prompt_len = input_ids.shape[1]
                self.lengths = [completion_length([t for t in row if t != pad_id], i)
                                for i, row in enumerate(input_ids.tolist())]
            made = input_ids.shape[1] - self.prompt_len  # tokens generated so far
            for i, length in enumerate(self.lengths):
                if made >= length - 1:  # this token is the last: EOS
                    scores[i] = -torch.inf
                    scores[i, eos_id] = 0.0
                else:
                    scores[i, eos_id] = -torch.inf
            return scores

    return LongTail()


class Rollouts:
    """What the module docstring lists, per optimizer step, for this rank."""

    def __init__(self):
        self.steps: list = []
        self._forwards = 0
        self._in_generate = False
        self._current: dict = {}
        self._step_started = 0.0

    # -- the policy --------------------------------------------------------------------------------------
    def instrument(self, model, pad_id: int, eos_id: int) -> None:
        """Count ``model``'s forwards inside ``generate`` and end its completions at long-tailed lengths. The
        wrapper is set on the instance before the engine is built, so an ODC engine's own binding of the
        instance's ``generate`` (``synced_gpus=False`` unless the caller says) wraps it, and on ZeRO-3
        transformers' ``synced_gpus`` default stays as it is."""
        from transformers import LogitsProcessorList

        model.register_forward_pre_hook(self._count)
        original = model.generate

        def generate(*args, **kwargs):
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(_long_tail_processor(pad_id, eos_id))
            before, started = self._forwards, time.perf_counter()
            self._in_generate = True
            try:
                output = original(*args, logits_processor=processors, **kwargs)
            finally:
                self._in_generate = False
            self._add("generate_s", time.perf_counter() - started)
            self._add("forwards", self._forwards - before)
            self._current["longest"] = max(self._current.get("longest", 0), max(processors[-1].lengths))
            return output

        model.generate = generate

    def _count(self, *_):
        if self._in_generate:
            self._forwards += 1

    def _add(self, key: str, value) -> None:
        self._current[key] = self._current.get(key, 0) + value

    # -- the trainer -------------------------------------------------------------------------------------
    def timed(self, function):
        """``function`` (TRL's generation phase), its seconds added to ``rollout_s``."""
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._add("rollout_s", time.perf_counter() - started)

        return run

    def callback(self):
        """A ``TrainerCallback`` timing each optimizer step and closing its record."""
        from transformers import TrainerCallback

        record = self

        class StepTimes(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                record._current = {}
                record._step_started = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                record.steps.append({**record._current, "step_s": time.perf_counter() - record._step_started})

        return StepTimes()


def gather(rollouts: Rollouts) -> list:
    """Every rank's steps, rank by rank (a collective: every rank calls it once, after training)."""
    import torch.distributed as dist

    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rollouts.steps)
    return ranks


def check_forwards(ranks: list, synced: bool) -> list:
    """Problems with the forwards each rank ran: its own longest completion per step when unsynced, the
    longest on any rank when synced (transformers' lockstep)."""
    problems = []
    for step, rows in enumerate(zip(*ranks)):
        longest = max(row["longest"] for row in rows)
        for rank, row in enumerate(rows):
            want = longest if synced else row["longest"]
            if row["forwards"] != want:
                problems.append(f"step {step + 1} rank {rank}: {row['forwards']} forwards inside generate, "
                                f"expected {want} ({'synced' if synced else 'its own longest completion'})")
    return problems
