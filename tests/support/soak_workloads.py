"""What the ranks run in the soak (``tests/compat/run_soak.py``): one long job on the odc stage, and what it
measures about itself.

Each step every rank runs its own number of micro-batches (0 to ``max_count``, drawn from the plan's seed; a
micro-batch may carry no loss token), per-token loss, after random sleeps; every ``offload_every`` steps
``engine.offload_states()`` / ``reload_states()`` (alternately between steps and in the middle of a step, after
the rank's first micro-batch); every ``checkpoint_every`` steps ``save_checkpoint`` (keeping the last ``keep``
tags), and at every other checkpoint a ``load_checkpoint`` of the tag just saved into the running engine. The
reference run is the same job with ``events=False``: no sleeps, no offload, no checkpoint.

Everything a rank keeps lives in tensors allocated before the first step (losses, resource samples), so the
record itself cannot make resident memory grow; what the parent needs for its one-process check (full
parameters and Adam moments around each checkpoint) goes to files in ``records``.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import time
from dataclasses import dataclass, replace
from typing import Optional

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_token_sum

#: resource columns of a sample, in order (see :func:`resources`)
COLUMNS = ("step", "rss_kib", "fds", "threads", "maps_ds_odc", "shm_ds_odc_own", "shm_ds_odc_all", "shm_deepspeed",
           "checkpoint_kib")
_SESSION = re.compile(r"ds_odc_([0-9a-f]{12})")


@dataclass(frozen=True)
class SoakPlan:
    """One run of the soak job. ``events=False`` makes the reference run: the same micro-batches, nothing else."""

    steps: int = 2000
    seed: int = 36
    hidden: int = 256
    layers: int = 4
    micro_size: int = 8
    max_count: int = 3
    masked_p: float = 0.1
    lr: float = 1e-3
    offload_every: int = 50
    checkpoint_every: int = 200
    keep: int = 2
    sample_every: int = 10
    max_delay_s: float = 0.004
    straggler_p: float = 0.05
    straggler_s: float = 0.05
    segment: int = 5
    events: bool = True
    checkpoint_dir: str = ""
    records: str = ""
    progress: Optional[str] = None

    def reference(self, records: str) -> "SoakPlan":
        return replace(self, events=False, checkpoint_dir="", records=records, progress=None)

    def checkpoints(self) -> list:
        return list(range(self.checkpoint_every, self.steps + 1, self.checkpoint_every))

    def loads_at(self, step: int) -> bool:
        """A load round trip at the first checkpoint and every other one after it."""
        return step % self.checkpoint_every == 0 and (step // self.checkpoint_every) % 2 == 1

    def offload_at(self, step: int) -> Optional[str]:
        """"mid" (after this rank's first micro-batch of ``step``), "after" (after the step), or None."""
        if step % self.offload_every:
            return None
        return "mid" if (step // self.offload_every) % 2 else "after"

    def recorded_steps(self) -> dict:
        """step -> what rank 0 writes to ``records`` after it: "state" (parameters and Adam moments, a segment's
        start) or "params" (a segment's end, and the checkpoint steps themselves)."""
        marks: dict = {}
        for step in self.checkpoints():
            marks[max(step - self.segment, 0)] = "state"
        for step in self.checkpoints():
            marks.setdefault(step, "params")
            marks.setdefault(min(step + self.segment, self.steps), "params")
        return marks


def plan_counts(plan: SoakPlan, world: int) -> torch.Tensor:
    """Micro-batches per step (row ``step - 1``) and rank, 0 to ``max_count``."""
    generator = torch.Generator().manual_seed(plan.seed)
    return torch.randint(0, plan.max_count + 1, (plan.steps, world), generator=generator)


def plan_masked(plan: SoakPlan, world: int) -> torch.Tensor:
    """Whether micro-batch (step - 1, rank, index) carries no loss token."""
    generator = torch.Generator().manual_seed(plan.seed + 1)
    return torch.rand(plan.steps, world, plan.max_count, generator=generator) < plan.masked_p


def sample(plan: SoakPlan, step: int, rank: int, index: int, masked: torch.Tensor):
    """(x, y, mask) of micro-batch ``index`` of ``rank`` at ``step`` (1-based): the same in the soak, the
    reference run and the parent's one-process check."""
    return micro_batch(step, rank, index, size=plan.micro_size, masked_out=bool(masked[step - 1, rank, index]))


def engine_config(plan: SoakPlan) -> dict:
    config = ds_config("odc", managed=False, lr=plan.lr, odc={"deterministic": True})
    # DeepSpeed's own Adam: what offload_states of the optimizer's states requires
    config["optimizer"] = {"type": "Adam", "params": {"lr": plan.lr, "weight_decay": 0.0}}
    return config


def resources(session: str, port: str, checkpoint_dir: str) -> list:
    """This process's resident memory (KiB), open descriptors, threads and mappings of ds_odc segments; the
    entries of /dev/shm that are this rank's ds_odc files (a peer's may still be there for a moment after a
    reload_states that returned here: each rank unlinks its own), anyone's ds_odc files, this job's DeepSpeed
    files (named after its port); the checkpoint directory's size (KiB)."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    with open("/proc/self/maps") as maps:
        mapped = sum(1 for line in maps if "ds_odc_" in line)
    shm = os.listdir("/dev/shm")
    own = f"_r{tdist.get_rank()}_"
    mine = sum(1 for name in shm if session and name.startswith(f"ds_odc_{session}") and own in name)
    every = sum(1 for name in shm if name.startswith("ds_odc_"))
    deepspeed_files = sum(1 for name in shm if name.startswith("deepspeed_") and f"_{port}_" in name)
    size = 0
    for root, _, files in os.walk(checkpoint_dir) if checkpoint_dir else ():
        size += sum(os.path.getsize(os.path.join(root, name)) for name in files)
    return [rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), mapped, mine, every,
            deepspeed_files, size // 1024]


def _session() -> str:
    """This engine's shm session, read from the segments it has mapped (their files are unlinked already)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if found := _SESSION.search(line):
                return found.group(1)
    return ""


def _record(engine, plan: SoakPlan, step: int, kind: str) -> None:
    """Full parameters (and, for "state", Adam's moments and step) after ``step``; written by rank 0."""
    params = full_params(engine)
    state = {}
    if kind == "state":
        for name, param in engine.module.named_parameters():
            if param.requires_grad:
                state[name] = {key: safe_get_full_optimizer_state(param, key).reshape(param.ds_shape).clone()
                               for key in ("exp_avg", "exp_avg_sq")}
        state["step"] = _adam_step(engine)
    if tdist.get_rank() == 0:
        torch.save({"params": params, "state": state}, os.path.join(plan.records, f"step{step}.pt"))


def _adam_step(engine) -> int:
    for value in engine.optimizer.optimizer.state.values():
        if "step" in value:
            return int(value["step"])
    return 0


def _prune(plan: SoakPlan, step: int) -> None:
    """Rank 0 removes the tag ``keep`` checkpoints back: every rank finished it long ago."""
    old = step - plan.keep * plan.checkpoint_every
    if tdist.get_rank() == 0 and old > 0:
        shutil.rmtree(os.path.join(plan.checkpoint_dir, f"step{old}"), ignore_errors=True)


def _progress(plan: SoakPlan, step: int, started: float, row: list) -> None:
    if plan.progress and tdist.get_rank() == 0:
        with open(plan.progress, "a") as out:
            out.write(f"step {step}/{plan.steps} {time.monotonic() - started:.0f}s rss {row[0] / 1024:.1f} MiB "
                      f"fds {row[1]} threads {row[2]}\n")


def soak_rank(plan: SoakPlan) -> dict:
    """Run the plan on this rank. Returns every micro-batch's loss (``losses[step - 1, index]``, NaN where the
    rank ran fewer), the resource samples (one row per ``sample_every`` steps, :data:`COLUMNS`), whether each
    load round trip gave back the parameters it saved, and how long the run took."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    counts, masked = plan_counts(plan, world), plan_masked(plan, world)
    marks = plan.recorded_steps()
    delays = random.Random(1000 * plan.seed + rank)
    losses = torch.full((plan.steps, plan.max_count), float("nan"), dtype=torch.float64)
    samples = torch.zeros(plan.steps // plan.sample_every + 1, len(COLUMNS), dtype=torch.int64)
    loads = torch.zeros(len(plan.checkpoints()), dtype=torch.int64)  # 1: restored exactly, -1: not, 0: none
    engine, *_ = deepspeed.initialize(model=make_model(layers=plan.layers, hidden=plan.hidden),
                                      config=engine_config(plan))
    session, port = _session(), os.environ.get("MASTER_PORT", "")
    samples[0] = torch.tensor([0, *resources(session, port, plan.checkpoint_dir)])
    if 0 in marks:
        _record(engine, plan, 0, marks[0])
    started = time.monotonic()
    for step in range(1, plan.steps + 1):
        offload = plan.offload_at(step) if plan.events else None
        if plan.events and delays.random() < plan.straggler_p:
            time.sleep(plan.straggler_s)
        for index in range(int(counts[step - 1, rank])):
            if plan.events:
                time.sleep(delays.uniform(0.0, plan.max_delay_s))
            if offload == "mid" and index == 1:
                engine.offload_states()
                engine.reload_states()
            x, y, mask = sample(plan, step, rank, index, masked)
            loss = mse_token_sum(engine(x), y, mask)
            engine.backward(loss, loss_tokens=int(mask.sum().item()))
            losses[step - 1, index] = loss.item()
        if offload == "mid" and counts[step - 1, rank] <= 1:  # this rank ran no second micro-batch
            engine.offload_states()
            engine.reload_states()
        engine.step()
        if offload == "after":
            engine.offload_states()
            engine.reload_states()
        if plan.events and step % plan.checkpoint_every == 0:
            tag = f"step{step}"
            engine.save_checkpoint(plan.checkpoint_dir, tag=tag)
            _prune(plan, step)
            if plan.loads_at(step):
                saved = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters() if p.requires_grad]
                engine.load_checkpoint(plan.checkpoint_dir, tag=tag)
                loaded = [safe_get_full_fp32_param(p) for p in engine.module.parameters() if p.requires_grad]
                same = all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True))
                loads[step // plan.checkpoint_every - 1] = 1 if same else -1
                del saved, loaded
        if step in marks:
            _record(engine, plan, step, marks[step])
        if step % plan.sample_every == 0:
            row = resources(session, port, plan.checkpoint_dir)
            samples[step // plan.sample_every] = torch.tensor([step, *row])
            if step % (10 * plan.sample_every) == 0:
                _progress(plan, step, started, row)
    seconds = time.monotonic() - started
    engine.destroy()
    return {"losses": losses, "samples": samples, "loads": loads, "seconds": seconds, "session": session}


# -- the parent's check: one process on the global batches, around each checkpoint -------------------------
def one_process_segment(plan: SoakPlan, world: int, start: dict, first: int, last: int) -> dict:
    """From the full parameters and Adam moments after step ``first`` (``start``, as :func:`_record` wrote
    them), steps ``first + 1`` to ``last`` in one process: every rank's micro-batches of a step summed in
    float64, divided by the step's global loss-token count (per-token rule), clipped as ZeRO-3 clips, then
    torch's Adam. Returns the parameters after ``last``."""
    from tests.support.workloads import clip_like_deepspeed

    counts, masked = plan_counts(plan, world), plan_masked(plan, world)
    model = make_model(layers=plan.layers, hidden=plan.hidden)
    model.load_state_dict(start["params"])
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.Adam([p for _, p in named], lr=plan.lr, weight_decay=0.0)
    for name, param in named:
        optimizer.state[param] = {"step": torch.tensor(float(start["state"]["step"])),
                                  "exp_avg": start["state"][name]["exp_avg"].clone(),
                                  "exp_avg_sq": start["state"][name]["exp_avg_sq"].clone()}
    for step in range(first + 1, last + 1):
        sums = [torch.zeros_like(p, dtype=torch.float64) for _, p in named]
        tokens = 0
        for rank in range(world):
            for index in range(int(counts[step - 1, rank])):
                x, y, mask = sample(plan, step, rank, index, masked)
                grads = torch.autograd.grad(mse_token_sum(model(x), y, mask), [p for _, p in named])
                for total, grad in zip(sums, grads, strict=True):
                    total += grad.double()
                tokens += int(mask.sum())
        for (_, param), total in zip(named, sums, strict=True):
            param.grad = (total / max(tokens, 1)).float()
        clip_like_deepspeed(model, 1.0)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
