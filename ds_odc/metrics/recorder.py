"""Per-rank step timelines: where each rank's time went, measured the same way on every engine.

A :class:`StepRecorder` is fed by hooks (:mod:`ds_odc.integration.metrics_hooks`) at points that
exist in ZeRO-3 and in ODC alike, so both are measured identically:

========== ================================================== ==========================================
kind       ZeRO-3                                             ODC
========== ================================================== ==========================================
gather     ``fetch_sub_module``: all-gather launch and wait   the same call: pulls from owners' windows
reduce     the gradient bucket's reduce-scatter               the same call: pushes into accumulators
step_wait  overflow check and grad-norm all-reduces           fence, norm exchange, publish rendezvous
optimizer  the rest of the boundary ``engine.step()``         the same
compute    forward + backward of a micro-batch, less the gather/reduce inside it
========== ================================================== ==========================================

Spans nest (a gather inside a micro-batch); only the innermost kind is charged, so the parts of a
step add up to its wall time (whatever is left is ``other``: data loading, user code).
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable, Optional

from ds_odc.metrics.report import StepReport

COMM_KINDS = ("gather", "reduce", "step_wait")

#: clock shared by every process on a host (CLOCK_MONOTONIC on Linux), so rank timelines align
clock: Callable[[], float] = time.perf_counter


class StepRecorder:
    """Accumulates one step at a time; keeps the last ``history`` reports and their timelines."""

    def __init__(self, rank: int, history: int = 1000, on_step: Optional[Callable[[StepReport], None]] = None):
        self.rank = rank
        self.enabled = True
        self.reports: collections.deque[StepReport] = collections.deque(maxlen=history)
        self.on_step = on_step
        self._steps = 0
        self._reset()

    def _reset(self) -> None:
        self._step_start: Optional[float] = None
        self._micro_start: Optional[float] = None
        self._micro_comm = 0.0
        self._compute: list[float] = []
        self._totals = dict.fromkeys(COMM_KINDS + ("optimizer",), 0.0)
        self._events: list[tuple[str, float, float]] = []
        self._depth = 0  # open spans, so nested comm spans are charged once

    # -- hooks -----------------------------------------------------------------------------------
    def begin_micro_batch(self) -> None:
        if not self.enabled:
            return
        now = clock()
        if self._micro_start is not None:  # the last one ended without engine.backward (loss.backward())
            self._close_micro_batch(now)
        if self._step_start is None:
            self._step_start = now
        self._micro_start, self._micro_comm = now, 0.0

    def end_micro_batch(self) -> None:
        if self.enabled and self._micro_start is not None:
            self._close_micro_batch(clock())

    def _close_micro_batch(self, now: float) -> None:
        self._compute.append(now - self._micro_start - self._micro_comm)
        self._events.append(("micro_batch", self._micro_start, now))
        self._micro_start = None

    @contextlib.contextmanager
    def span(self, kind: str):
        """Charge the wall time of the block to ``kind`` (one of ``COMM_KINDS``), unless an enclosing
        span already charges it."""
        if not self.enabled or self._depth:
            yield
            return
        self._depth += 1
        start = clock()
        try:
            yield
        finally:
            end = clock()
            self._depth -= 1
            if self._step_start is None:
                self._step_start = start
            elapsed = end - start
            self._totals[kind] += elapsed
            if self._micro_start is not None:
                self._micro_comm += elapsed
            self._events.append((kind, start, end))

    @contextlib.contextmanager
    def optimizer_step(self):
        """The boundary ``engine.step()``: its time less the spans inside it is optimizer time."""
        if not self.enabled:
            yield
            return
        self.end_micro_batch()
        start = clock()
        if self._step_start is None:
            self._step_start = start
        inside_before = sum(self._totals.values())
        try:
            yield
        finally:
            end = clock()
            inside = sum(self._totals.values()) - inside_before
            self._totals["optimizer"] += max(0.0, end - start - inside)
            self._events.append(("optimizer", start, end))
            self._finish_step(end)

    def _finish_step(self, end: float) -> None:
        report = StepReport(rank=self.rank, step=self._steps, start=self._step_start, wall_s=end - self._step_start,
                            compute_s=tuple(self._compute), gather_s=self._totals["gather"],
                            reduce_s=self._totals["reduce"], step_wait_s=self._totals["step_wait"],
                            optimizer_s=self._totals["optimizer"], events=tuple(self._events))
        self.reports.append(report)
        self._steps += 1
        self._reset()
        if self.on_step is not None:
            self.on_step(report)

    @property
    def last(self) -> Optional[StepReport]:
        return self.reports[-1] if self.reports else None
