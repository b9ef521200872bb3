"""How much of the pull and push work ran while the rank was computing, from a step's timeline.

*Compute* is a micro-batch's span less the charged spans inside it (gathers, reduces: where the compute
stream waited); *pull* and *push* are the side-stream spans ``StepRecorder.device_span`` records. The
hidden fraction of a kind is the time its spans overlap compute over the time they cover; time covered
twice (two pulls queued back to back) counts once. On a GPU the timeline comes from CUDA events
([Note: GPU spans] in :mod:`ds_odc.metrics.timing`), so this is overlap on the device, not in the host's
queueing.

>>> from ds_odc.metrics.step_report import StepReport
>>> events = (("micro_batch", 0.0, 10.0), ("gather", 2.0, 3.0), ("pull", 1.0, 4.0), ("push", 9.0, 12.0))
>>> r = StepReport(rank=0, step=0, start=0.0, wall_s=12.0, compute_s=(9.0,), gather_s=1.0, reduce_s=0.0,
...                step_wait_s=0.0, optimizer_s=0.0, events=events, timing="cuda-events")
>>> hidden(r, "pull")   # 3 s of pulls, 2 of them beside compute (1-2 and 3-4)
Hidden(kind='pull', busy_s=3.0, hidden_s=2.0)
>>> round(hidden(r, "push").fraction, 3)  # 9-10 beside compute, 10-12 after it
0.333
"""
from __future__ import annotations

from typing import Iterable, List, NamedTuple, Sequence, Tuple

from ds_odc.metrics.step_report import StepReport

Interval = Tuple[float, float]
STALLS = ("gather", "reduce", "step_wait")


class Hidden(NamedTuple):
    kind: str
    busy_s: float
    """time covered by the kind's spans (overlaps between them counted once)"""
    hidden_s: float
    """of which the rank was computing"""

    @property
    def fraction(self) -> float:
        return self.hidden_s / self.busy_s if self.busy_s > 0 else 0.0


def merge(intervals: Iterable[Interval]) -> List[Interval]:
    """Sorted, disjoint union of ``intervals``.

    >>> merge([(3, 4), (0, 2), (1, 2.5)])
    [(0, 2.5), (3, 4)]
    """
    merged: List[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def subtract(intervals: Sequence[Interval], holes: Sequence[Interval]) -> List[Interval]:
    """``intervals`` less ``holes`` (both merged first).

    >>> subtract([(0, 10)], [(2, 3), (5, 6)])
    [(0, 2), (3, 5), (6, 10)]
    """
    out: List[Interval] = []
    holes = merge(holes)
    for start, end in merge(intervals):
        for hole_start, hole_end in holes:
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                out.append((start, hole_start))
            start = max(start, hole_end)
        if end > start:
            out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum((end - start for start, end in merge(intervals)), 0.0)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def compute_intervals(report: StepReport) -> List[Interval]:
    """When the rank computed: its micro-batches less the stalls charged inside them."""
    micro = [(s, e) for kind, s, e in report.events if kind == "micro_batch"]
    stalls = [(s, e) for kind, s, e in report.events if kind in STALLS]
    return subtract(micro, stalls)


def hidden(report: StepReport, kind: str) -> Hidden:
    """The ``kind`` ("pull" or "push") work of one step, and how much of it overlapped compute."""
    spans = merge((s, e) for k, s, e in report.events if k == kind)
    return Hidden(kind, length(spans), length(intersect(spans, compute_intervals(report))))


def hidden_over(reports: Iterable[StepReport], kind: str) -> Hidden:
    """:func:`hidden` summed over several reports (ranks and steps)."""
    parts = [hidden(r, kind) for r in reports]
    return Hidden(kind, sum(p.busy_s for p in parts), sum(p.hidden_s for p in parts))
