"""How the step recorder reads time: host clock readings on CPU, CUDA events on a CUDA device.

[Note: GPU spans]
On a GPU the host only *queues* work: a pull is a copy on the transport's pull stream, a push a kernel
on ZeRO-3's reduce stream, a forward a stream of kernels, and the host call returns long before the work
is done. Host timestamps around those calls measure the queueing, not the work, so a host-timed
timeline cannot show whether pulls and pushes overlap compute. On CUDA the recorder therefore marks
each span with an event recorded on a stream (the current stream unless told otherwise) and resolves
every event of a step at the step's end. Each event is placed on the host clock through one anchor:
after the device is synchronised, a last event is recorded and waited for, and the host clock is read;
an event's time is that reading minus its elapsed time to the anchor. Ranks' timelines therefore stay
comparable (one clock per host), and the parts of a step still add up to its wall time.

A span on the current stream measures what that stream did between the marks: the gather span around
ZeRO-3's ``fetch_sub_module`` is the time the compute stream waited for its parameters (the pull time
that was not hidden), and a step-wait span the time the device sat idle in the rendezvous. The work of
the side streams themselves (each pull, each push) is recorded with ``device_span(kind, stream)``: not
charged to the step's parts, drawn in the timeline, and measured against compute by
:mod:`ds_odc.metrics.overlap`.

Resolving waits for the device (``torch.cuda.synchronize``) once per step. ODC's step synchronises
anyway (every rendezvous round does), so the cost is nil there; on ZeRO-3 it adds one synchronisation
per step.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence


class HostTimer:
    """Marks are host clock readings (work on the CPU runs when the host calls it)."""

    name = "host"

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock

    def mark(self, stream=None) -> float:
        return self._clock()

    def resolve(self, marks: Sequence) -> List[float]:
        return list(marks)


class CudaEventTimer:
    """Marks are CUDA events recorded on a stream of ``device``; :meth:`resolve` turns them into host
    clock times (see the module's note). The torch entry points are injectable so that the bookkeeping
    can be tested without a GPU."""

    name = "cuda-events"

    def __init__(self, device, clock: Callable[[], float], event_factory: Optional[Callable] = None,
                 current_stream: Optional[Callable] = None, synchronize: Optional[Callable] = None):
        import torch

        self.device = device
        self._clock = clock
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._current = current_stream or (lambda: torch.cuda.current_stream(device))
        self._synchronize = synchronize or (lambda: torch.cuda.synchronize(device))
        self._free: list = []  # resolved events, reused: creating one per span would cost a driver call

    def mark(self, stream=None):
        event = self._free.pop() if self._free else self._event()
        event.record(stream if stream is not None else self._current())
        return event

    def resolve(self, marks: Sequence) -> List[float]:
        """Host times of ``marks``; then every distinct event goes back to the free list once.

        A mark may appear several times in ``marks`` (the recorder shares one between the end of a
        micro-batch and the start of the next, and a step's first mark is also a span's start). Freed
        once per appearance, one event would sit in the free list twice and be handed to two live marks
        of a later step: the earlier span would read the later time, and the list would grow each step."""
        self._synchronize()  # every stream's marks have completed
        anchor = self.mark()
        anchor.synchronize()
        now = self._clock()
        times = [now - mark.elapsed_time(anchor) / 1e3 for mark in marks]
        distinct = {id(mark): mark for mark in marks}
        distinct.pop(id(anchor), None)
        self._free.extend(distinct.values())
        self._free.append(anchor)
        return times


def timer_for(device, clock: Callable[[], float]):
    """The timer for a recorder on ``device``: CUDA events on a CUDA device, the host clock elsewhere.
    ``device=None`` asks DeepSpeed's accelerator, which places the engine, with the current device."""
    import torch

    if device is None:
        device = _accelerator_device()
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return CudaEventTimer(device, clock)
    return HostTimer(clock)


def _accelerator_device():
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:  # pragma: no cover - ds_odc depends on DeepSpeed
        return "cpu"
    accelerator = get_accelerator()
    if accelerator.device_name() != "cuda":
        return "cpu"
    return accelerator.device_name(accelerator.current_device())
