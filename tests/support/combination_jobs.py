"""Training jobs that combine the features the docs promise, each drawn from a seed alone, and the oracle of
which of them the odc stage must refuse, and with which words (``tests/distributed/test_combinations.py``,
``tests/compat/run_combinations.py``; ``docs/combinations.md`` says what is covered).

Pure: no torch, no DeepSpeed, no process. :func:`draw` turns an integer seed into a :class:`Job` (a frozen
dataclass: every axis value and the step-by-step layout of samples over ranks), the same on every machine and
Python (only ``random.Random(seed).random()`` is drawn from). ``Job.describe()`` is the one line a failure
report prints; ``draw(job.seed) == job`` reproduces it.

What a job runs (:mod:`tests.support.combination_workloads` on the ranks, :mod:`tests.support.combination_reference`
in one process): ``steps`` optimizer steps of a tiny Llama on token sequences; every step is a :class:`StepLayout`
of samples (lengths, and how many leading tokens carry no label) grouped into :class:`Entry` micro-batches, each run
by one rank, by the ranks of a fixed sequence-parallel group (each its slice), or split over a group by the split
policy. The axes (:data:`AXES`) say how: the loss and its rule, accumulation, precision, optimizer, clipping,
offloads, a frozen reference model, activation checkpointing and offload, parallelism, and the calls between steps
(``offload_states``, a checkpoint saved and loaded into a fresh engine, ``generate``).
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

WORLD = 2
STEPS = 3
#: The split policy's balance block (tokens per member under the cap; samples of 2 x 4 tokens may split).
SPLIT_CAP = 48
MIN_CHUNK_TOKENS = 4

#: axis -> (values, weights): what :func:`draw` chooses from, in this order. The first value is the plain one.
AXES: Dict[str, Tuple[Tuple, Tuple[float, ...]]] = {
    # "sp": ALST's mpu, fixed groups of 2; "split": balance policy "lb-mini-split", groups per micro-batch;
    # "sp+split": both at once, which initialize refuses
    "parallel": (("none", "sp", "split", "sp+split"), (6, 2, 3, 0.3)),
    # "token": engine.backward(loss_sum, loss_tokens=n); "mean": the micro-batch's token mean (under SP the
    # sequence's, gathered in the group as HF computes it); "scaled": the slice's token sum x world / the step's
    # global token count (the HF Trainer's num_items_in_batch loss)
    "loss": (("token", "mean", "scaled"), (1, 1, 1)),
    "managed": ((True, False), (1, 1)),  # DeepSpeed's managed accumulation, or "managed_gradient_accumulation": false
    "gas": ((1, 2, 3), (1, 1, 1)),  # gradient_accumulation_steps in the ds_config
    "scale_wrt_gas": ((True, False), (2, 1)),  # engine.backward(loss, scale_wrt_gas=...)
    "backward": (("engine", "torch"), (3, 1)),  # engine.backward(loss), or loss.backward() on the engine's output
    "coalesce": ((False, True), (4, 1)),  # each step's backwards inside engine.coalesce_grad_reduction()
    "counts": (("equal", "uneven", "zero"), (1, 1, 1)),  # micro-batches per rank; "zero": some rank runs none
    "dtype": (("fp32", "bf16"), (2, 1)),
    "optimizer": (("sgd", "adamw", "fused-adam"), (2, 1, 1)),  # SGD+momentum; torch AdamW; DeepSpeed's FusedAdam
    "clip": (("off", "engaged", "idle"), (1, 1, 1)),  # gradient_clipping 0, 0.05 (clips), 100 (never clips)
    "offload": (("none", "optimizer", "param", "both"), (4, 1, 1, 1)),  # offload_optimizer / offload_param to CPU
    "reference_model": (("none", "inside", "outside"), (2, 1, 1)),  # a frozen engine's forwards feeding the loss
    "checkpointing": (("none", "reentrant", "non-reentrant"), (3, 1, 1)),  # HF gradient checkpointing
    "activation_offload": (("none", "all", "checkpoint_inputs"), (3, 1, 1)),  # odc.activation_offload, budget 0
    # engine.offload_states() / reload_states() before a step's micro-batches, or after each rank's first backward
    # (before that micro-batch's engine.step(), a one-micro-batch rank's boundary: the call is collective on odc)
    "offload_states": (("none", "between", "mid"), (3, 1, 1)),
    # which states: every one (include=None), the two ODC windows, or the rank's own (fp32 master, optimizer
    # state, gradient bucket); only read when offload_states is not "none"
    "offload_include": (("all", "windows", "own"), (1, 1, 1)),
    "checkpoint": ((False, True), (4, 1)),  # save_checkpoint, a fresh engine (other weights) loads it, trains on
    "generate": ((False, True), (4, 1)),  # model.generate() between steps, each rank its own number of tokens
    # the policy engine's odc.accumulator_dtype; "bf16" only with a bf16 model (:func:`_accumulator`): under an
    # fp32 one it is refused at initialize, which tests/distributed/test_config_errors.py checks
    "accumulator": (("fp32", "fp64", "bf16"), (2, 1, 3)),
}
#: Axes added after the fixed seeds were chosen, each drawn from a stream of its own (the seed plus the offset):
#: the seed's own stream is drawn as before, so every earlier job keeps its other values and its layout.
OWN_STREAM_AXES: Dict[str, int] = {"accumulator": 1 << 40}
OFFLOAD_INCLUDE = {"all": None, "windows": ("lp_params", "lp_grads"),
                   "own": ("hp_params", "optim_states", "contiguous_grad_buffer")}
#: new tokens each rank generates (ranks stop at different tokens: no lockstep on the odc stage)
NEW_TOKENS = (2, 5, 3, 4)


@dataclass(frozen=True)
class Entry:
    """One micro-batch: the step's ``samples`` packed in this order, run by ``ranks`` (one rank; every rank of a
    fixed SP group, each its slice; or a split micro-batch's group, each its slice)."""
    samples: Tuple[int, ...]
    ranks: Tuple[int, ...]
    split: bool = False


@dataclass(frozen=True)
class StepLayout:
    """One optimizer step: every sample's length and label-less prefix (``prompts[i]`` >= 1 leading tokens
    carry no label: as a packing collator leaves each sample's first token; ``prompts[i] == lengths[i]``: no
    loss token at all), and the micro-batches in the order their ranks run them."""
    lengths: Tuple[int, ...]
    prompts: Tuple[int, ...]
    entries: Tuple[Entry, ...]

    def entries_for(self, rank: int) -> List[Entry]:
        return [entry for entry in self.entries if rank in entry.ranks]

    def tokens(self, sample: int) -> int:
        """Loss tokens of a sample: the shifted labels of positions ``prompts[i] - 1 .. length - 2``."""
        return self.lengths[sample] - self.prompts[sample]

    @property
    def global_tokens(self) -> int:
        return sum(self.tokens(i) for i in range(len(self.lengths)))


@dataclass(frozen=True)
class Job:
    seed: int
    parallel: str
    loss: str
    managed: bool
    gas: int
    scale_wrt_gas: bool
    backward: str
    coalesce: bool
    counts: str
    dtype: str
    optimizer: str
    clip: str
    offload: str
    reference_model: str
    checkpointing: str
    activation_offload: str
    offload_states: str
    offload_include: str
    checkpoint: bool
    generate: bool
    accumulator: str
    layout: Tuple[StepLayout, ...] = field(repr=False)
    #: the step before whose micro-batches each call happens (None: not in this job)
    offload_at: Optional[int] = None
    checkpoint_at: Optional[int] = None
    generate_at: Optional[int] = None
    world: int = WORLD

    @classmethod
    def from_seed(cls, seed: int) -> "Job":
        return draw(seed)

    # -- what the axes mean together -------------------------------------------------------------------------
    @property
    def sp_size(self) -> int:
        return 2 if self.parallel in ("sp", "sp+split") else 1

    @property
    def split(self) -> bool:
        return self.parallel in ("split", "sp+split")

    @property
    def rule(self) -> str:
        """The normalisation rule the engine applies (docs/normalisation.md): "token" (loss_tokens), "mean" (managed
        accumulation over more than one step, the loss divided by gradient_accumulation_steps: the mean over every
        micro-batch of every rank) or "caller" (the sum of what was passed, divided by the world size)."""
        if self.loss == "token":
            return "token"
        divides = self.scale_wrt_gas or self.backward == "torch"  # loss.backward() takes DeepSpeed's default
        return "mean" if self.managed and divides and self.gas > 1 else "caller"

    @property
    def caller_divides_by_gas(self) -> bool:
        """Under the caller's rule, whether DeepSpeed divides each loss by gradient_accumulation_steps (it does
        with scale_wrt_gas, managed or not; the mean rule keeps that division too and corrects it at the step)."""
        return self.rule == "caller" and self.gas > 1 and (self.scale_wrt_gas or self.backward == "torch")

    @property
    def deepspeed_boundary(self) -> bool:
        """Managed accumulation with every rank at gradient_accumulation_steps micro-batches every step: DeepSpeed
        counts the boundary itself. Otherwise (managed) each rank sets it on its own last micro-batch, as accelerate
        does."""
        return self.managed and not self.coalesce and all(
            len(step.entries_for(rank)) == self.gas for step in self.layout for rank in range(self.world))

    def counts_per_step(self) -> List[Tuple[int, ...]]:
        return [tuple(len(step.entries_for(rank)) for rank in range(self.world)) for step in self.layout]

    @property
    def zero3_comparable(self) -> bool:
        """Whether ZeRO-3 can run the same job on the same config: every rank the same micro-batch count in every
        step (its per-layer collectives), none of the odc stage's own features (loss_tokens, the split policy), and,
        under the mean rule, that count equal to gradient_accumulation_steps (ZeRO-3 divides by it, not by the count
        run). Activation offload is left out of ZeRO-3's config (it changes no number); a frozen engine is not
        offloaded there (ZeRO-3 refuses to). Nor can ZeRO-3 step right after offloading its gradient partitions
        (``offload_states`` "mid" with ``lp_grads`` included, on a step of one micro-batch per rank): offloading and
        reloading them empties its record of them (``averaged_gradients = {}``), which only a later backward fills
        again, so its step fails (KeyError 0; the random search met it). The odc stage's windows keep theirs."""
        counts = self.counts_per_step()
        if self.loss == "token" or self.split or any(len(set(c)) != 1 or c[0] == 0 for c in counts):
            return False
        lp_grads = self.offload_include in ("all", "windows") and self.offload not in ("optimizer", "both")
        last = self.offload_at is not None and counts[self.offload_at][0] == 1  # the step follows the offload
        if self.offload_states == "mid" and lp_grads and last:
            return False  # (with offload_optimizer DeepSpeed leaves the gradients out of include by itself)
        return self.rule != "mean" or all(c[0] == self.gas for c in counts)

    def describe(self) -> str:
        parts = [f"seed={self.seed}"]
        for name in AXES:
            value = getattr(self, name)
            if value != AXES[name][0][0] or name in ("loss", "dtype", "optimizer", "counts"):
                parts.append(f"{name}={value}")
        if self.offload_states == "none":
            parts = [p for p in parts if not p.startswith("offload_include=")]
        for name in ("offload_at", "checkpoint_at", "generate_at"):
            if getattr(self, name) is not None:
                parts.append(f"{name}={getattr(self, name)}")
        parts.append(f"rule={self.rule}")
        parts.append("counts/step=" + " ".join("/".join(map(str, c)) for c in self.counts_per_step()))
        parts.append("lengths=" + " ".join(",".join(map(str, s.lengths)) for s in self.layout))
        splits = [sum(e.split for e in s.entries) for s in self.layout]
        if any(splits):
            parts.append("split entries/step=" + "/".join(map(str, splits)))
        return " ".join(parts)


# -- drawing ----------------------------------------------------------------------------------------------------
class _Draw:
    """``random.Random(seed).random()`` only: its sequence is fixed across Python releases (choice and randrange
    are not guaranteed to be)."""

    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def pick(self, values: Sequence, weights: Optional[Sequence[float]] = None):
        weights = list(weights) if weights is not None else [1.0] * len(values)
        point = self._rng.random() * sum(weights)
        for value, weight in zip(values, weights):
            point -= weight
            if point < 0:
                return value
        return values[-1]

    def integer(self, low: int, high: int) -> int:
        """Uniform in [low, high]."""
        return low + min(int(self._rng.random() * (high - low + 1)), high - low)

    def chance(self, p: float) -> bool:
        return self._rng.random() < p


def _counts(d: _Draw, kind: str, units: int, gas: int, prefer_gas: bool) -> List[int]:
    """Micro-batches per unit (rank, or SP group) for one step."""
    if kind == "equal" or units == 1 and kind == "uneven":
        count = gas if prefer_gas and d.chance(0.7) else d.integer(1, 3)
        return [count] * units
    if kind == "uneven":
        while True:
            counts = [d.integer(1, 3) for _ in range(units)]
            if len(set(counts)) > 1:
                return counts
    counts = [d.integer(1, 3) if d.chance(0.85) else 0 for _ in range(units)]  # every unit idle now and then
    counts[d.integer(0, units - 1)] = 0
    return counts


def _prompt(d: _Draw, length: int, loss: str) -> int:
    """Leading tokens without a label: at least 1 (the first token never has one); a sample without any loss token
    now and then where the loss allows it (a mean needs a token in every micro-batch)."""
    if loss != "mean" and d.chance(0.15):
        return length
    return d.integer(1, max(1, length - 2))


def _new_sample(d: _Draw, lengths: List[int], low: int, high: int, even: bool = False) -> int:
    """A sample of a length in [low, high] (even: for an SP group of 2) added to ``lengths``; its index."""
    length = d.integer(low, high)
    if even:
        length += length % 2
    lengths.append(length)
    return len(lengths) - 1


def _layout(d: _Draw, job: dict) -> Tuple[StepLayout, ...]:
    world, loss = job["world"], job["loss"]
    prefer_gas = job["managed"] and job["gas"] > 1
    steps = []
    for _ in range(STEPS):
        lengths: List[int] = []
        entries: List[Entry] = []
        sample = functools.partial(_new_sample, d, lengths)
        if job["parallel"] in ("sp", "sp+split"):
            groups = world // 2
            counts = _counts(d, job["counts"], groups, job["gas"], prefer_gas)
            for index in range(max(counts)):  # group g's i-th micro-batch: a full sequence, each member its half
                for group in range(groups):
                    if index < counts[group]:
                        entries.append(Entry((sample(4, 20, even=True),), (2 * group, 2 * group + 1)))
        elif job["parallel"] == "split":
            for _ in range(d.integer(1, 2)):  # split micro-batches over ranks 0-1, run first, in this order
                packed = tuple(sample(14, 40) for _ in range(d.pick((1, 2), (3, 1))))
                entries.append(Entry(packed, (0, 1), split=True))
            counts = [max(c - 1, 0) for c in _counts(d, job["counts"], world, 1, False)]  # whole ones: 0-2
            for rank in range(world):
                for _ in range(counts[rank]):
                    packed = tuple(sample(4, 14) for _ in range(d.pick((1, 2), (2, 1))))
                    entries.append(Entry(packed, (rank,)))
        else:
            counts = _counts(d, job["counts"], world, job["gas"], prefer_gas)
            for rank in range(world):
                for _ in range(counts[rank]):
                    entries.append(Entry((sample(4, 20),), (rank,)))
        prompts = tuple(_prompt(d, length, loss) for length in lengths)
        steps.append(StepLayout(tuple(lengths), prompts, tuple(entries)))
    return tuple(steps)


def accumulators(dtype: str) -> Tuple[Tuple[str, ...], Tuple[float, ...]]:
    """The accumulator dtypes drawn with a model of ``dtype`` and their weights: every value of the axis with a
    bf16 model, fp32 and fp64 with an fp32 one."""
    values, weights = AXES["accumulator"]
    return (values, weights) if dtype == "bf16" else (values[:2], weights[:2])


def draw(seed: int) -> Job:
    """The job of ``seed``: every axis drawn with :data:`AXES`' weights, then the layout of its samples."""
    d = _Draw(seed)
    values = {name: d.pick(choices, weights) for name, (choices, weights) in AXES.items()
              if name not in OWN_STREAM_AXES}
    values["accumulator"] = _Draw(seed + OWN_STREAM_AXES["accumulator"]).pick(*accumulators(values["dtype"]))
    values["world"] = WORLD
    layout = _layout(d, values)
    between = [d.integer(1, STEPS - 1) for _ in range(3)]  # after at least one step
    return Job(seed=seed, layout=layout,
               offload_at=between[0] if values["offload_states"] != "none" else None,
               checkpoint_at=between[1] if values["checkpoint"] else None,
               generate_at=between[2] if values["generate"] else None, **values)


# -- the oracle -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Refusal:
    """What the engine must do with a combination it cannot honour: raise, on at least one rank, an error whose
    text holds ``fragment``, at ``phase`` ("initialize", or "train": the first call that meets it), because of
    ``reason``. The other ranks may raise that too, or a peer error naming the rank that raised it."""
    reason: str
    fragment: str
    phase: str = "train"


#: Refusals, in the order a job meets them (the first that applies is the one expected). Each: (reason, predicate,
#: fragment of the error text, phase). Where the refusal is documented: docs/combinations.md.
REFUSALS: Tuple[Tuple[str, object, str, str], ...] = (
    ("the split policy with a fixed SP mpu", lambda j: j.parallel == "sp+split",
     "leave the fixed SP mpu", "initialize"),
    ("coalesce_grad_reduction() without managed accumulation (DeepSpeed's own assertion)",
     lambda j: j.coalesce and not j.managed, "not supported with managed_gradient_accumulation=False", "train"),
    ("a mean inside a split micro-batch (it would weigh the sample once per member)",
     lambda j: j.split and (j.rule == "mean" or j.rule == "caller" and j.loss == "mean"),
     "would count the sample once per member", "train"),
    ("generate() under fixed sequence parallelism (decoding cannot be cut into slices)",
     lambda j: j.generate and j.sp_size > 1, "sequence parallelism", "train"),
    ("offload_states() with the parameters offloaded (ZeRO-3's own assertion)",
     lambda j: j.offload_states != "none" and j.offload in ("param", "both"),
     "Moving states across devices is not supported for offloaded parameters", "train"),
    ("offload_states() of the optimizer's own states without DeepSpeed's FusedAdam (ZeRO-3's own assertion)",
     # with the optimizer offloaded DeepSpeed leaves those states (and the gradients) out of include by itself
     lambda j: j.offload_states != "none" and j.offload_include in ("all", "own") and j.optimizer != "fused-adam"
     and j.offload not in ("optimizer", "both"),
     "Offloading is supported only for DeepSpeed FusedAdam", "train"),
)


def expected_refusal(job: Job) -> Optional[Refusal]:
    """The oracle: None when the engine must train the job, else the refusal it must raise (the first one the job
    meets: initialize's, then step 0's block and backward, then the calls between steps in step order)."""
    applying = [(phase != "initialize", _when(job, reason), index, Refusal(reason, fragment, phase))
                for index, (reason, applies, fragment, phase) in enumerate(REFUSALS) if applies(job)]  # type: ignore
    return min(applying, key=lambda item: item[:3])[3] if applying else None


def _when(job: Job, reason: str) -> int:
    if reason.startswith("generate()"):
        return job.generate_at or 0
    if reason.startswith("offload_states()"):
        return job.offload_at or 0
    return 0


# -- what the axes cover ----------------------------------------------------------------------------------------
def axis_values(job: Job) -> Dict[str, object]:
    """The job's value on every axis, the irrelevant ones left out (offload_include without offload_states)."""
    values = {name: getattr(job, name) for name in AXES}
    if job.offload_states == "none":
        del values["offload_include"]
    return values


def pairs(job: Job) -> set:
    """Every pair of (axis, value) the job combines."""
    items = sorted((name, repr(value)) for name, value in axis_values(job).items())
    return set(itertools.combinations(items, 2))


def census() -> Dict[str, object]:
    """How many combinations the axes span and how many of them the oracle refuses, by reason. Layouts and the
    steps of the calls between steps are drawn too and not counted. The oracle reads few axes: the product of those
    is enumerated (with representative values for the layout-dependent ones), the rest multiply; precision and
    accumulator count as the pairs of them that are drawn (:func:`accumulators`)."""
    read = ("parallel", "loss", "managed", "gas", "scale_wrt_gas", "backward", "coalesce", "optimizer", "offload",
            "offload_states", "offload_include", "generate")
    precisions = sum(len(accumulators(dtype)[0]) for dtype in AXES["dtype"][0])
    total = precisions
    for name, (values, _) in AXES.items():
        total *= 1 if name in ("dtype", "accumulator") else len(values)
    rest = total
    for name in read:
        rest //= len(AXES[name][0])
    refused: Dict[str, int] = {}
    template = draw(0)
    for combo in itertools.product(*(AXES[name][0] for name in read)):
        job = _replace(template, dict(zip(read, combo)))
        refusal = expected_refusal(job)
        if refusal is not None:
            refused[refusal.reason] = refused.get(refusal.reason, 0) + rest
    return {"axes": {name: len(values) for name, (values, _) in AXES.items()}, "precisions": precisions,
            "total": total, "refused": sum(refused.values()), "by_reason": refused}


def _replace(job: Job, values: dict) -> Job:
    current = {f.name: getattr(job, f.name) for f in fields(job)}
    current.update(values)
    current["generate_at"] = 1 if current["generate"] else None
    current["offload_at"] = 1 if current["offload_states"] != "none" else None
    return Job(**current)


#: relative cost of a job's parts, for choosing a fixed set of seeds that fits a time budget (:func:`cover`)
_COST = {"engine": 1.0, "step": 0.4, "sp": 0.4, "split": 0.6, "checkpoint": 1.5, "generate": 0.3, "zero3": 2.0}


def estimated_cost(job: Job) -> float:
    """A rough relative cost: engines built, steps run, what the calls between steps add, ZeRO-3's run."""
    if expected_refusal(job) is not None:
        return _COST["engine"]
    cost = _COST["engine"] * (1 + (job.reference_model != "none")) + _COST["step"] * STEPS
    cost += _COST["sp"] * (job.sp_size > 1) + _COST["split"] * job.split
    cost += _COST["checkpoint"] * job.checkpoint + _COST["generate"] * job.generate
    return cost * (2 if job.zero3_comparable else 1)


def cover(candidates: Sequence[int], budget: float, start: Sequence[int] = ()) -> List[int]:
    """Seeds chosen greedily from ``candidates`` after ``start`` (seeds already chosen, whose cost counts against
    the budget): first one job per refusal reason not yet among them, then the job that adds the most pairs of
    axis values not yet covered (by jobs that train) per unit of :func:`estimated_cost`, until the budget is spent
    or nothing is left to add."""
    jobs = {seed: draw(seed) for seed in (*start, *candidates)}
    chosen: List[int] = list(start)
    spent = sum(estimated_cost(jobs[seed]) for seed in chosen)
    refused = {r.reason for seed in chosen if (r := expected_refusal(jobs[seed])) is not None}
    for reason, *_ in REFUSALS:
        if reason in refused:
            continue
        seed = next(s for s, j in jobs.items() if (r := expected_refusal(j)) is not None and r.reason == reason)
        chosen.append(seed)
        spent += estimated_cost(jobs[seed])
    trained = {seed: pairs(job) for seed, job in jobs.items() if expected_refusal(job) is None}
    covered: set = set().union(*(trained.get(seed, set()) for seed in chosen))
    while True:
        best, best_gain = None, 0.0
        for seed, job_pairs in trained.items():
            if seed in chosen:
                continue
            gain = len(job_pairs - covered) / estimated_cost(jobs[seed])
            if gain > best_gain:
                best, best_gain = seed, gain
        if best is None or spent + estimated_cost(jobs[best]) > budget:
            return chosen
        chosen.append(best)
        covered |= trained[best]
        spent += estimated_cost(jobs[best])


def judged_against_zero3(job: Job) -> bool:
    """Whether the job's parameters are held to ZeRO-3's as well as one process's: it trains, ZeRO-3 can run it
    (:attr:`Job.zero3_comparable`), and it is fp32 (the fp32 bar holds against both; a bf16 job's ZeRO-3 run is
    only shown, under ``COMBINATIONS_DEBUG``)."""
    return expected_refusal(job) is None and job.zero3_comparable and job.dtype == "fp32"


def zero3_values(job: Job) -> set:
    """The axis values (and the normalisation rule) a job judged against ZeRO-3 puts to ZeRO-3's numbers."""
    return {(n, repr(v)) for n, v in axis_values(job).items()} | {("rule", repr(job.rule))}


def zero3_cover(candidates: Sequence[int], start: Sequence[int] = ()) -> List[int]:
    """Seeds added greedily to ``start`` from ``candidates`` until every axis value and rule that any of the
    candidates' jobs judged against ZeRO-3 takes is taken by one of the chosen: the most new values per unit of
    :func:`estimated_cost` first."""
    judged = {seed: zero3_values(job) for seed in candidates if judged_against_zero3(job := draw(seed))}
    chosen = list(start)
    covered = set().union(*(zero3_values(draw(seed)) for seed in chosen if judged_against_zero3(draw(seed))))
    wanted = set().union(*judged.values())
    while not wanted <= covered:
        best = max(judged, key=lambda seed: len(judged[seed] - covered) / estimated_cost(draw(seed)))
        chosen.append(best)
        covered |= judged[best]
    return chosen


def coverage(seeds: Sequence[int], universe: Sequence[int]) -> Dict[str, object]:
    """What ``seeds`` cover: the axis values and pairs of them among their jobs that train, against every value
    and pair that jobs of ``universe`` train with; the refusal reasons among them; and the axis values and rules
    that their jobs judged against ZeRO-3 take, against those of ``universe``'s."""
    def trained(pool):
        return [draw(s) for s in pool if expected_refusal(draw(s)) is None]

    def against_zero3(jobs):
        return set().union(*(zero3_values(j) for j in jobs if judged_against_zero3(j)))

    mine, every = trained(seeds), trained(universe)
    values = {(n, repr(v)) for j in mine for n, v in axis_values(j).items()}
    all_values = {(n, repr(v)) for j in every for n, v in axis_values(j).items()}
    mine_pairs = set().union(*(pairs(j) for j in mine)) if mine else set()
    all_pairs = set().union(*(pairs(j) for j in every))
    reasons = {r.reason for s in seeds if (r := expected_refusal(draw(s))) is not None}
    zero3, all_zero3 = against_zero3(mine), against_zero3(every)
    return {"values": (len(values & all_values), len(all_values)), "pairs": (len(mine_pairs & all_pairs),
            len(all_pairs)), "missing_values": sorted(all_values - values), "reasons": sorted(reasons),
            "zero3_values": (len(zero3 & all_zero3), len(all_zero3)), "missing_zero3": sorted(all_zero3 - zero3)}
