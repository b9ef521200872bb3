"""Projection of splitting only the long samples (``ds_odc.balance.split``) against whole-sample balancing
and fixed sequence parallelism, on the golden setting's machine.

A split plan is replayed as the runtime (``ds_odc/integration/split_attention.py``) runs it: every rank runs its split
micro-batches first, in the plan's order, each starting when its last member is free; then its whole
ones back to back. A micro-batch runs on the ODC timeline of :mod:`benchmarks.sim.timeline` (its own
pulls and pushes per layer, prefetched one layer ahead) with compute = its cost under the plan's cost
model; for a split one that is the member's share of the sample plus Ulysses' all-to-alls, which sit on
the critical path (:mod:`ds_odc.balance.split_cost`). Members of a group start together and last
equally long in the model, so the all-to-alls never wait for a late partner here; on a real machine
noise makes them wait.

Fixed SP of ``p`` (only where ``p <= max_group``: the model's heads must divide by it) runs every
sample over a group (``world / p`` replicas planned with LB-Mini, one simulated rank per group, as
:mod:`benchmarks.sim.sequence_parallel`), priced with the same all-to-all model: per micro-batch
``layers · all_to_alls_per_layer`` latencies, per token the bytes.

Idle fraction, for every method alike: ``1 - useful / (ranks × step)``, where useful is every sample's
whole cost once (no fixed costs, no communication); so all-to-alls, exposed pulls, fixed costs and
waiting all count as idle.

>>> from ds_odc.balance.split import plan_split
>>> from ds_odc.balance.split_cost import AllToAllCost, SplitCostModel
>>> lengths = longalign_like_lengths(8, seed=1, minimum=512)
>>> plan = plan_split(lengths, 8, GOLDEN_TOKEN_CAP, GOLDEN_COST_MODEL, AllToAllCost())
>>> result = simulate_split_step(plan, hierarchical_preset(8))
>>> result.step_seconds >= plan.step_cost()  # the plan's own step is the bound of its replay
True
"""
from __future__ import annotations

import dataclasses
import statistics
import time

from benchmarks.sim.hardware import Hardware
from benchmarks.sim.presets import GOLDEN_COST_MODEL, GOLDEN_TOKEN_CAP, hierarchical_preset, longalign_like_lengths
from benchmarks.sim.timeline import StepResult, odc_rank_seconds, simulate_step
from ds_odc.balance import CostModel, plan_minibatch
from ds_odc.balance.split import plan_split
from ds_odc.balance.split_cost import AllToAllCost, SplitCostModel
from ds_odc.balance.split_plan import SplitPlan
from ds_odc.errors import ODCError

METHODS = ("odc lb-mini", "zero3 lb-micro", "sp 2", "sp 4", "sp 8", "odc split")
"""The table's columns: ODC + LB-Mini (whole samples), ZeRO-3 + LB-Micro, fixed SP on ODC + LB-Mini over
the groups, ODC + the split planner."""
LENGTH_MINIMUM = 512
"""The issue's lengths: lognormal of mean 16.5K clipped to [512, 64K]."""


def simulate_split_step(plan: SplitPlan, hardware: Hardware) -> StepResult:
    """Replay one step of ``plan`` on ``hardware`` (ODC); see the module docstring."""
    scale = hardware.seconds_per_cost_unit
    ready = [0.0] * plan.world_size
    for split in plan.splits:
        start = max(ready[r] for r in split.ranks)
        end = start + odc_rank_seconds([plan.member_cost(split) * scale], hardware)
        for r in split.ranks:
            ready[r] = end
    finish = []
    for rank, batches in enumerate(plan.whole):
        costs = [plan.cost.whole([plan.lengths[i] for i in batch]) * scale for batch in batches]
        finish.append(ready[rank] + (odc_rank_seconds(costs, hardware) if costs else 0.0))
    step = max(finish, default=0.0) + hardware.fence_seconds + hardware.optimizer_seconds
    busy = tuple(cost * scale for cost in plan.rank_costs())
    counts = tuple(len(plan.for_rank(rank)) for rank in range(plan.world_size))
    return StepResult("odc", step, tuple(finish), busy, counts)


def fixed_sp_cost_model(base: CostModel, all_to_all: AllToAllCost, sp: int) -> CostModel:
    """What a packed micro-batch costs each rank of a fixed SP group of ``sp``: compute divided by the
    group, plus the all-to-alls (their latencies once per micro-batch, their bytes per token); the same
    prices the planner gives a split micro-batch (:meth:`~ds_odc.balance.split_cost.SplitCostModel.fixed_group_model`).

    >>> model = fixed_sp_cost_model(CostModel(quadratic=1.0, linear=1.0), AllToAllCost.free(), 2)
    >>> model.quadratic, model.linear, model.per_micro_batch
    (0.5, 0.5, 0.0)
    """
    return SplitCostModel(base, all_to_all).fixed_group_model(sp)


@dataclasses.dataclass(frozen=True)
class SplitProjection:
    """Per method: mean step seconds and idle fraction over the cell's minibatches, and the worst idle."""

    world_size: int
    samples_per_rank: int
    steps: int
    step_seconds: dict
    idle: dict
    worst_idle: dict
    plan_idle: float
    """The split plans' idle under their own cost model (no pulls, no fixed costs of the step)."""
    mean_splits: float
    """Samples run split per step (mean)."""
    group_sizes: dict
    """How many samples per step ran over 2, 4 and 8 ranks (means)."""
    fixed_share: float
    """Share of steps whose plan split every sample over one group size (a fixed-SP layout won)."""
    plan_ms: float
    """Median milliseconds of one ``plan_split`` call on this machine."""


def project_split(world_size: int, samples_per_rank: int, steps: int = 20, seed: int = 0, sigma: float = 0.7,
                  all_to_all: AllToAllCost | None = None, min_chunk_tokens: int = 2048, node_size: int = 8,
                  max_group: int = 8, methods=METHODS) -> SplitProjection:
    """Simulate every method of ``methods`` on the same ``steps`` LongAlign-like minibatches (golden cost,
    token cap 64K per rank, ``hierarchical_preset``: pulls inside a node, one exchange between nodes)."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ODCError(f"unknown method {unknown[0]!r}; choose from {METHODS}")
    a2a = all_to_all or AllToAllCost()
    hardware = hierarchical_preset(world_size)
    cap, model = GOLDEN_TOKEN_CAP, GOLDEN_COST_MODEL
    seconds: dict = {m: [] for m in methods}
    idle: dict = {m: [] for m in methods}
    plan_idle, splits, sizes, plan_ms, fixed = [], [], {2: 0, 4: 0, 8: 0}, [], 0
    for step in range(steps):
        lengths = longalign_like_lengths(world_size * samples_per_rank, seed=seed * 100003 + step, sigma=sigma,
                                         minimum=LENGTH_MINIMUM)
        useful = sum(model.sample_costs(lengths))
        for method in methods:
            if method == "odc lb-mini":
                result = simulate_step(plan_minibatch(lengths, world_size, cap, "lb-mini", model, seed=step),
                                       hardware, "odc")
            elif method == "zero3 lb-micro":
                result = simulate_step(plan_minibatch(lengths, world_size, cap, "lb-micro", model, seed=step),
                                       hardware, "collective")
            elif method.startswith("sp "):
                sp = int(method.split()[1])
                if world_size % sp or sp > max_group:
                    continue
                sp_model = fixed_sp_cost_model(model, a2a, sp)
                plan = plan_minibatch(lengths, world_size // sp, cap * sp, "lb-mini", sp_model, seed=step)
                result = simulate_step(plan, hardware, "odc")
            else:  # "odc split"
                started = time.perf_counter()
                plan = plan_split(lengths, world_size, cap, model, a2a, node_size=node_size, max_group=max_group,
                                  min_chunk_tokens=min_chunk_tokens, seed=step)
                plan_ms.append(1e3 * (time.perf_counter() - started))
                result = simulate_split_step(plan, hardware)
                plan_idle.append(plan.idle_fraction())
                splits.append(sum(len(split.samples) for split in plan.splits))
                for split in plan.splits:
                    sizes[split.group_size] = sizes.get(split.group_size, 0) + len(split.samples)
                fixed += not any(plan.whole) and len({split.group_size for split in plan.splits}) == 1
            seconds[method].append(result.step_seconds)
            idle[method].append(1.0 - useful / (world_size * result.step_seconds))
    kept = [m for m in methods if seconds[m]]
    return SplitProjection(world_size, samples_per_rank, steps,
                           {m: statistics.fmean(seconds[m]) for m in kept},
                           {m: statistics.fmean(idle[m]) for m in kept},
                           {m: max(idle[m]) for m in kept},
                           statistics.fmean(plan_idle) if plan_idle else float("nan"),
                           statistics.fmean(splits) if splits else 0.0,
                           {p: count / steps for p, count in sizes.items()}, fixed / steps,
                           statistics.median(plan_ms) if plan_ms else float("nan"))
