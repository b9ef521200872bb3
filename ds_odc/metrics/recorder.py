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

Besides the parts, a step carries named amounts (:meth:`StepRecorder.count`: tokens, bytes pulled and pushed,
...), the seconds of *measured* spans that are not parts of the step (:meth:`StepRecorder.measure`: the
cross-node exchange, split micro-batches), every rank's micro-batch count where the engine's step learns it,
and the balance planner's prediction (:meth:`StepRecorder.note_plan`).

Time is read by a timer (:mod:`ds_odc.metrics.timing`): the host clock on CPU, CUDA events on a CUDA
device (see [Note: GPU spans] there), chosen from the device the recorder is given, or from DeepSpeed's
accelerator when none is. Marks are kept as they are taken and turned into times when the step ends,
which is when events can be read without stalling the device.
"""
from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

from ds_odc.metrics.step_report import PlannedStep, StepReport

COMM_KINDS = ("gather", "reduce", "step_wait")

#: clock shared by every process on a host (CLOCK_MONOTONIC on Linux), so rank timelines align
clock: Callable[[], float] = time.perf_counter


def _clock() -> float:
    return clock()  # looked up at each call, so a test's replacement of ``clock`` is seen


@dataclass
class _Span:
    kind: str
    start: object  # a timer mark, resolved at the step's end
    end: object = None
    within: Optional[int] = None
    """index of the micro-batch it was charged inside, -1 inside the optimizer step, None outside both"""


@dataclass
class _Step:
    micro_batches: List[_Span] = field(default_factory=list)
    spans: List[_Span] = field(default_factory=list)      # charged: gather, reduce, step_wait
    device: List[_Span] = field(default_factory=list)     # drawn only: pull, push
    measured: List[_Span] = field(default_factory=list)   # summed into counters only: cross_node, split
    counters: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    all_micro_batches: tuple = ()
    plan: Optional[PlannedStep] = None
    first: object = None                                  # the step's first mark


class StepRecorder:
    """Accumulates one step at a time; keeps the last ``history`` reports and their timelines.

    ``device``: where the engine computes (CUDA events there, host clock on CPU); ``None`` asks
    DeepSpeed's accelerator at the first mark. ``timer``: a ready-made timer (tests)."""

    def __init__(self, rank: int, history: int = 1000, on_step: Optional[Callable[[StepReport], None]] = None,
                 device=None, timer=None):
        self.rank = rank
        self.enabled = True
        self.reports: collections.deque[StepReport] = collections.deque(maxlen=history)
        self.on_step = on_step
        self._device = device
        self._timer = timer
        self._steps = 0
        self._reset()

    @property
    def timing(self) -> str:
        """"host" or "cuda-events" (decided at the first mark when no device or timer was given)."""
        return self._get_timer().name

    def _get_timer(self):
        if self._timer is None:
            from ds_odc.metrics.timing import timer_for
            self._timer = timer_for(self._device, _clock)
        return self._timer

    def _mark(self, stream=None):
        """A new mark. One mark may serve twice (a step's first mark is also a span's start; a micro-batch's
        end is the next one's start): timers resolve and recycle each distinct mark once (timing.py)."""
        mark = self._get_timer().mark(stream)
        if self._step.first is None:
            self._step.first = mark
        return mark

    def _reset(self) -> None:
        self._step = _Step()
        self._micro: Optional[_Span] = None
        self._in_optimizer = False
        self._depth = 0  # open spans, so nested comm spans are charged once

    # -- hooks -----------------------------------------------------------------------------------
    def begin_micro_batch(self) -> None:
        if not self.enabled:
            return
        now = self._mark()
        if self._micro is not None:  # the last one ended without engine.backward (loss.backward())
            self._micro.end = now
        self._micro = _Span("micro_batch", now)
        self._step.micro_batches.append(self._micro)

    def end_micro_batch(self) -> None:
        if self.enabled and self._micro is not None:
            self._micro.end = self._mark()
            self._micro = None

    @contextlib.contextmanager
    def span(self, kind: str):
        """Charge the time of the block to ``kind`` (one of ``COMM_KINDS``), unless an enclosing
        span already charges it."""
        if not self.enabled or self._depth:
            yield
            return
        self._depth += 1
        within = len(self._step.micro_batches) - 1 if self._micro is not None else (-1 if self._in_optimizer else None)
        record = _Span(kind, self._mark(), within=within)
        try:
            yield
        finally:
            record.end = self._mark()
            self._depth -= 1
            self._step.spans.append(record)

    @contextlib.contextmanager
    def device_span(self, kind: str, stream=None):
        """Record the work queued in the block on ``stream`` (default: the current one) as ``kind``
        ("pull" or "push"): drawn in the timeline and measured against compute
        (:mod:`ds_odc.metrics.overlap`), never charged to the step's parts. Nesting is allowed."""
        if not self.enabled:
            yield
            return
        record = _Span(kind, self._mark(stream))
        try:
            yield
        finally:
            record.end = self._mark(stream)
            self._step.device.append(record)

    @contextlib.contextmanager
    def measure(self, kind: str):
        """Time the block as ``kind``: summed into the step's counter ``<kind>_s``, neither charged to the step's
        parts nor drawn (the cross-node exchange inside the step, a split micro-batch)."""
        if not self.enabled:
            yield
            return
        record = _Span(kind, self._mark())
        try:
            yield
        finally:
            record.end = self._mark()
            self._step.measured.append(record)

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside (the figures' own exchange after a step: charged to no step)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def count(self, name: str, amount: float) -> None:
        """Add ``amount`` to the step's counter ``name`` (tokens, bytes, ...)."""
        if self.enabled:
            self._step.counters[name] += amount

    def note_micro_batches(self, per_rank) -> None:
        """Every rank's micro-batch count in this step, as the engine's step learned them (ODC's fence)."""
        if self.enabled:
            self._step.all_micro_batches = tuple(int(c) for c in per_rank)

    def note_plan(self, plan: PlannedStep) -> None:
        """The balance planner's prediction for the step under way (the last one noted before it ends counts)."""
        if self.enabled:
            self._step.plan = plan

    @contextlib.contextmanager
    def optimizer_step(self):
        """The boundary ``engine.step()``: its time less the spans inside it is optimizer time."""
        if not self.enabled:
            yield
            return
        self.end_micro_batch()
        record = _Span("optimizer", self._mark())
        self._in_optimizer = True
        try:
            yield
        finally:
            record.end = self._mark()
            self._in_optimizer = False
            self._finish_step(record)

    def _finish_step(self, optimizer: _Span) -> None:
        step = self._step
        spans = [s for s in step.micro_batches + step.spans + step.device + step.measured + [optimizer]
                 if s.end is not None]
        marks = [step.first] + [m for s in spans for m in (s.start, s.end)]
        times = iter(self._get_timer().resolve(marks))
        start = next(times)
        resolved = [(s, next(times), next(times)) for s in spans]
        totals = dict.fromkeys(COMM_KINDS, 0.0)
        # charged span time per micro-batch (index) and in the optimizer (-1)
        inside: collections.Counter[int] = collections.Counter()
        for span, begin, end in resolved:
            if span.kind in COMM_KINDS:
                totals[span.kind] += end - begin
                if span.within is not None:
                    inside[span.within] += end - begin
        micro_index = {id(m): i for i, m in enumerate(step.micro_batches)}
        compute = tuple(end - begin - inside[micro_index[id(s)]] for s, begin, end in resolved
                        if s.kind == "micro_batch")
        counters, measured = step.counters, {id(s) for s in step.measured}
        for span, begin, end in resolved:
            if id(span) in measured:
                counters[f"{span.kind}_s"] += end - begin
        _, opt_begin, opt_end = resolved[-1]
        report = StepReport(rank=self.rank, step=self._steps, start=start, wall_s=opt_end - start, compute_s=compute,
                            gather_s=totals["gather"], reduce_s=totals["reduce"], step_wait_s=totals["step_wait"],
                            optimizer_s=max(0.0, opt_end - opt_begin - inside[-1]),
                            events=tuple((s.kind, begin, end) for s, begin, end in resolved if id(s) not in measured),
                            timing=self._get_timer().name, counters=tuple(sorted(counters.items())),
                            all_micro_batches=step.all_micro_batches, plan=step.plan)
        self.reports.append(report)
        self._steps += 1
        self._reset()
        if self.on_step is not None:
            self.on_step(report)

    @property
    def last(self) -> Optional[StepReport]:
        return self.reports[-1] if self.reports else None
