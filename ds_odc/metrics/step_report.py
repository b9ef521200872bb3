"""What one rank did in one optimizer step, and utilisation over ranks and steps.

Utilisation = busy / wall, busy = compute + optimizer: the time a rank spent doing its own work.
Pull/all-gather, push/reduce-scatter and the step rendezvous are not busy time (on a collective
engine they are also where a rank waits for slower ones).

>>> r = StepReport(rank=0, step=3, start=0.0, wall_s=2.0, compute_s=(0.9, 0.6), gather_s=0.1, reduce_s=0.1,
...                step_wait_s=0.2, optimizer_s=0.1)
>>> round(r.utilisation, 3), round(r.other_s, 3)
(0.8, 0.0)
>>> r.log_line()
'step 3 rank 0 | wall 2.000s busy 80.0% | 2 micro-batches compute 1.500s gather 0.100s reduce 0.100s step-wait 0.200s optimizer 0.100s'
"""  # noqa: E501 - a doctest's expected output is one line
from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence


@dataclasses.dataclass(frozen=True)
class PlannedStep:
    """What a balance planner predicted for one step (``ds_odc.metrics.note_plan``): each rank's cost and the
    step's, in the cost model's unit (seconds under ``"cost_model": "measure"``, tokens under ``"tokens"``).

    >>> PlannedStep((3.0, 1.0), 3.0).balance
    0.6666666666666666
    """

    rank_costs: tuple[float, ...]
    step_cost: float

    @property
    def balance(self) -> float:
        """Mean rank cost over the busiest rank's: the compute balance the plan predicts (1 = perfectly even)."""
        return balance(self.rank_costs)


def balance(loads: Sequence[float]) -> float:
    """Mean over the largest of ``loads`` (1.0 when all are 0)."""
    busiest = max(loads, default=0.0)
    return sum(loads) / (len(loads) * busiest) if busiest > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class StepReport:
    rank: int
    step: int
    start: float
    """clock time (shared by the processes of a host) at which the step's first micro-batch began"""
    wall_s: float
    compute_s: tuple[float, ...]
    """compute time of each micro-batch, in order"""
    gather_s: float
    reduce_s: float
    step_wait_s: float
    optimizer_s: float
    events: tuple[tuple[str, float, float], ...] = ()
    """(kind, start, end) spans for timeline plots: micro_batch, gather, reduce, step_wait, optimizer; and
    pull, push: work on a side stream (``StepRecorder.device_span``), drawn but not part of any total"""
    timing: str = "host"
    """how the times were read: "host" (clock readings) or "cuda-events" (``ds_odc.metrics.timing``)"""
    counters: tuple[tuple[str, float], ...] = ()
    """named amounts of the step, by name (``StepRecorder.count`` and ``measure``; docs/metrics.md lists them):
    ``tokens``, ``pull_bytes``, ``push_bytes``, ``offload_bytes``, ``split_micro_batches``, and the seconds of
    measured spans, ``<kind>_s`` (``cross_node_s``, ``split_s``)"""
    all_micro_batches: tuple[int, ...] = ()
    """every rank's micro-batch count in this step, where the engine's step learned them (ODC's fence); else empty"""
    plan: Optional[PlannedStep] = None
    """the balance planner's prediction for this step, when one was noted"""

    def counter(self, name: str, default: float = 0.0) -> float:
        return next((value for key, value in self.counters if key == name), default)

    def has_counter(self, name: str) -> bool:
        return any(key == name for key, _ in self.counters)

    @property
    def micro_batches(self) -> int:
        return len(self.compute_s)

    @property
    def busy_s(self) -> float:
        return sum(self.compute_s) + self.optimizer_s

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - self.busy_s - self.gather_s - self.reduce_s - self.step_wait_s)

    @property
    def utilisation(self) -> float:
        return self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def log_line(self) -> str:
        return (f"step {self.step} rank {self.rank} | wall {self.wall_s:.3f}s busy {100 * self.utilisation:.1f}% | "
                f"{self.micro_batches} micro-batches compute {sum(self.compute_s):.3f}s gather {self.gather_s:.3f}s "
                f"reduce {self.reduce_s:.3f}s step-wait {self.step_wait_s:.3f}s optimizer {self.optimizer_s:.3f}s")

    def without_events(self) -> "StepReport":
        return dataclasses.replace(self, events=())


def utilisation(reports: Iterable[StepReport]) -> float:
    """Busy time over wall time, summed over every report given (ranks and steps)."""
    reports = list(reports)
    wall = sum(r.wall_s for r in reports)
    return sum(r.busy_s for r in reports) / wall if wall > 0 else 0.0


def step_line(reports_of_one_step: Sequence[StepReport], with_step: bool = True) -> str:
    """One line for a step across ranks:
    ``step 7 | utilisation 97.1% | rank 0 98.0% (3 mb) | rank 1 96.2% (5 mb)``."""
    ordered = sorted(reports_of_one_step, key=lambda r: r.rank)
    ranks = " | ".join(f"rank {r.rank} {100 * r.utilisation:.1f}% ({r.micro_batches} mb)" for r in ordered)
    line = f"utilisation {100 * utilisation(ordered):.1f}% | {ranks}"
    return f"step {ordered[0].step} | {line}" if with_step else line
