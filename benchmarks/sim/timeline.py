"""Replay one optimizer step of a plan, layer by layer, under a collective engine or under ODC.

Every rank runs a flat sequence of layer operations: for each of its micro-batches, the forward of
layers ``0..L-1`` then the backward of ``L-1..0``. Each operation needs that layer's parameters
gathered first; each backward operation is followed by a gradient reduce. The two schemes differ
only in *who waits for whom*:

- ``"collective"`` (ZeRO-3 / FSDP): every gather and reduce is a collective over all ranks, so it
  starts only when the last rank has issued it and ends at the same moment on every rank. Ranks
  with fewer micro-batches run empty ones so the collectives match: full communication, and the
  cost model's fixed per-micro-batch part (``micro_batch_cost([])``), as an empty micro-batch still
  runs every layer. (That never moves the balance bound: at every index some rank runs a real
  micro-batch, which costs at least as much.) With prefetch a fast rank may run ahead of a slow one
  by at most ``prefetch_depth`` layers; at every layer it waits again.
- ``"odc"``: gathers and reduces are one rank's own point-to-point pulls and pushes, limited only by
  that rank's bandwidth; no rank waits for another until the step, where all meet once
  (``fence_seconds``) before the optimizer. Owners are not modelled as a shared resource: with
  all-to-all links a puller's own port carries the same ``(D-1)/D`` of a layer as a ring would,
  and that port is the limit; a slower fabric is a larger ``pull_seconds``/``push_seconds``.

The step lasts from the first operation until the optimizer is done on every rank (the paper's
minibatch wall time). With free communication and no fixed costs, a collective step with
``prefetch_depth=0`` equals :meth:`Plan.collective_step_cost` and an ODC step equals
:meth:`Plan.odc_step_cost`; that is the balance bound, and everything else the simulator adds is
communication it can or cannot hide.

>>> from ds_odc.balance import CostModel, Plan
>>> plan = Plan("lb-mini", (3, 1, 1, 1), 4, CostModel.tokens(), (((0,),), ((1,), (2,), (3,))))
>>> hw = Hardware(layers=2, prefetch_depth=0)
>>> simulate_step(plan, hw, "collective").step_seconds, simulate_step(plan, hw, "odc").step_seconds
(5.0, 3.0)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from benchmarks.sim.hardware import Hardware
from ds_odc.balance import CostModel, Plan
from ds_odc.errors import ODCError

SCHEMES = ("collective", "odc")


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one simulated step looked like, per rank and overall (all in seconds)."""

    scheme: str
    step_seconds: float
    rank_finish_seconds: tuple[float, ...]
    """When each rank's last compute and its last transfer were done, before the step sync."""
    rank_busy_seconds: tuple[float, ...]
    """Compute time of each rank (its micro-batches' cost), excluding waits and fixed costs."""
    micro_batches_run: tuple[int, ...]
    """Micro-batches each rank ran, counting a collective engine's empty padding ones."""

    @property
    def utilisation(self) -> float:
        """Busy rank-time over wall rank-time: 1 - bubble rate."""
        if self.step_seconds == 0:
            return 1.0
        return sum(self.rank_busy_seconds) / (len(self.rank_busy_seconds) * self.step_seconds)


def simulate_step(plan: Plan, hardware: Hardware, scheme: str, cost_model: CostModel | None = None) -> StepResult:
    """Simulate one optimizer step of ``plan`` on ``hardware`` under ``scheme`` ("collective" or "odc").

    ``cost_model`` is the *true* cost of a micro-batch (default: the plan's own); pass another one to
    see how a plan made with a rough model (say token counts) runs on real costs."""
    if scheme not in SCHEMES:
        raise ODCError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    model = cost_model or plan.cost_model
    scale = hardware.seconds_per_cost_unit
    costs = [[model.micro_batch_cost([plan.lengths[i] for i in batch]) * scale for batch in batches]
             for batches in plan.micro_batches]
    if scheme == "collective":
        depth = max((len(c) for c in costs), default=0)
        empty = model.micro_batch_cost([]) * scale
        padded = [c + [empty] * (depth - len(c)) for c in costs]
        finish = _run_group(padded, hardware, hardware.gather_seconds, hardware.reduce_seconds,
                            hardware.collective_micro_batch_seconds)
        step = max(finish, default=0.0) + hardware.optimizer_seconds
        counts = tuple(depth for _ in costs)
    else:
        finish = [odc_rank_seconds(c, hardware) for c in costs]
        step = max(finish, default=0.0) + hardware.fence_seconds + hardware.optimizer_seconds
        counts = tuple(len(c) for c in costs)
    return StepResult(scheme, step, tuple(finish), tuple(sum(c) for c in costs), counts)


def odc_rank_seconds(micro_batch_costs: Sequence[float], hardware: Hardware) -> float:
    """Seconds one ODC rank takes for micro-batches of these costs (seconds, already scaled) run back to
    back: its own pulls, compute and pushes, no step sync (the timeline of :func:`simulate_step`'s ODC ranks)."""
    return _run_group([list(micro_batch_costs)], hardware, hardware.pull_seconds, hardware.push_seconds,
                      hardware.odc_micro_batch_seconds)[0]


def _layer_operations(micro_batch_costs: Sequence[float], hardware: Hardware):
    """Per rank: (compute seconds, is backward) for every layer operation, in the order it runs."""
    layers = hardware.layers
    ops = []
    for cost in micro_batch_costs:
        forward = cost * (1.0 - hardware.backward_fraction) / layers
        backward = cost * hardware.backward_fraction / layers
        ops.extend((forward, False) for _ in range(layers))
        ops.extend((backward, True) for _ in range(layers))
    return ops


def _run_group(rank_costs: list[list[float]], hardware: Hardware, gather: float, reduce: float,
               micro_batch_overhead: float) -> list[float]:
    """Run ranks that share every transfer (one rank alone for ODC); return each rank's finish time.

    A transfer starts when every rank of the group has issued it and the group's channel is free
    (transfers run one at a time in issue order), and ends ``gather``/``reduce`` seconds later on
    every rank of the group. All ranks of a group run the same number of operations."""
    ranks = len(rank_costs)
    if ranks == 0:
        return []
    per_rank_ops = [_layer_operations(costs, hardware) for costs in rank_costs]
    count = len(per_rank_ops[0])
    if any(len(ops) != count for ops in per_rank_ops):
        raise ODCError("collective ranks must run the same number of layer operations (pad first)")
    if count == 0:
        return [0.0] * ranks
    ops_per_micro_batch = 2 * hardware.layers
    prefetch = hardware.prefetch_depth
    channel_free = 0.0
    gather_end = [0.0] * count
    previous_end = [0.0] * ranks

    def issue_gather(op: int, issue_times: Sequence[float]) -> None:
        nonlocal channel_free
        start = max(max(issue_times), channel_free)
        channel_free = gather_end[op] = start + gather

    if prefetch:
        zeros = [0.0] * ranks
        for op in range(min(prefetch, count)):
            issue_gather(op, zeros)
    for op in range(count):
        if not prefetch:
            issue_gather(op, previous_end)
        fixed = micro_batch_overhead if op % ops_per_micro_batch == 0 else 0.0
        starts = [max(end, gather_end[op]) + fixed for end in previous_end]  # fixed work is serial
        if prefetch and op + prefetch < count:
            issue_gather(op + prefetch, starts)
        previous_end = [start + ops[op][0] for start, ops in zip(starts, per_rank_ops)]
        if per_rank_ops[0][op][1]:  # a backward operation: its gradients are reduced when all are done
            channel_free = max(max(previous_end), channel_free) + reduce
    return [max(end, channel_free) for end in previous_end]
