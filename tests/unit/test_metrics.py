"""Step recorder arithmetic and the timeline plot, driven by a fake clock."""
import pytest

import ds_odc.metrics.recorder as recorder_module
from ds_odc.metrics import StepRecorder, plot_timelines, step_line, utilisation


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(recorder_module, "clock", clock)
    return clock


def run_step(recorder, clock, micro_batches, step_wait):
    """micro_batches: list of (compute, gather inside it) seconds."""
    for compute, gather in micro_batches:
        recorder.begin_micro_batch()
        clock.advance(compute / 2)
        with recorder.span("gather"):
            clock.advance(gather)
            with recorder.span("reduce"):  # nested: charged to the outer span only
                clock.advance(0.5)
        clock.advance(compute / 2)
        recorder.end_micro_batch()
    with recorder.optimizer_step():
        with recorder.span("step_wait"):
            clock.advance(step_wait)
        clock.advance(0.25)


def test_parts_add_up_to_the_wall_time(fake_clock):
    recorder = StepRecorder(rank=1)
    run_step(recorder, fake_clock, [(2.0, 0.5), (1.0, 0.0)], step_wait=3.0)
    report = recorder.last
    assert report.rank == 1 and report.step == 0 and report.micro_batches == 2
    assert report.compute_s == (2.0, 1.0)
    assert report.gather_s == 1.5 and report.reduce_s == 0.0  # (0.5 + 0.5) + (0.0 + 0.5): nested reduce
    assert report.step_wait_s == 3.0 and report.optimizer_s == 0.25
    assert report.wall_s == pytest.approx(2 + 1 + 1.5 + 3 + 0.25)
    assert report.other_s == pytest.approx(0.0)
    assert report.utilisation == pytest.approx(3.25 / 7.75)
    assert [kind for kind, _, _ in report.events].count("micro_batch") == 2


def test_steps_are_separate_and_torch_style_backward_closes_at_the_next_forward(fake_clock):
    recorder = StepRecorder(rank=0)
    run_step(recorder, fake_clock, [(1.0, 0.0)], step_wait=0.0)
    recorder.begin_micro_batch()  # loss.backward(): no engine.backward to close it
    fake_clock.advance(1.0)
    recorder.begin_micro_batch()
    fake_clock.advance(2.0)
    with recorder.optimizer_step():
        fake_clock.advance(1.0)
    first, second = recorder.reports
    assert second.step == 1 and second.compute_s == (1.0, 2.0) and second.wall_s == pytest.approx(4.0)
    assert first.compute_s == (1.0,)  # the 0.5 s span inside the micro-batch is charged to gather


def test_disabled_recorder_records_nothing(fake_clock):
    recorder = StepRecorder(rank=0)
    recorder.enabled = False
    run_step(recorder, fake_clock, [(1.0, 0.1)], step_wait=1.0)
    assert recorder.last is None


def test_step_line_and_overall_utilisation(fake_clock):
    recorders = [StepRecorder(rank=r) for r in range(2)]
    run_step(recorders[0], fake_clock, [(4.0, 0.0)], step_wait=0.0)
    run_step(recorders[1], fake_clock, [(1.0, 0.0), (1.0, 0.0)], step_wait=2.0)
    reports = [r.last for r in recorders]
    line = step_line(reports)
    assert line.startswith("step 0 | utilisation ") and "rank 0 " in line and "(2 mb)" in line
    assert utilisation(reports) == pytest.approx((4.25 + 2.25) / (4.75 + 5.25))


def test_timeline_plot_writes_a_png(fake_clock, tmp_path):
    runs = {}
    for label, skew in (("ZeRO-3", 3.0), ("ODC", 0.0)):
        recorders = [StepRecorder(rank=r) for r in range(2)]
        for recorder in recorders:
            run_step(recorder, fake_clock, [(1.0, skew)], step_wait=1.0)
        runs[label] = [r.last for r in recorders]
    path = plot_timelines(runs, str(tmp_path / "timeline.png"), title="test")
    with open(path, "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"


# -- CUDA-event timing, driven by a fake device ([Note: GPU spans] in ds_odc/metrics/timing.py) ---------
class FakeGpu:
    """Streams that reach each event at a time the test sets (``at[stream]``), as a GPU runs queued
    work later than the host queues it; events are counted, to see that they are reused."""

    def __init__(self):
        self.at = {"compute": 0.0, "pull": 0.0}
        self.anchor = 0.0  # where the compute stream is once the timer has synchronised the device
        self.created = 0

    def event(self):
        self.created += 1
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, gpu):
        self.gpu, self.t, self.stream = gpu, None, None

    def record(self, stream):
        self.stream, self.t = stream, self.gpu.at[stream]

    def elapsed_time(self, other):  # milliseconds, as torch.cuda.Event.elapsed_time
        return (other.t - self.t) * 1e3

    def synchronize(self):
        pass


@pytest.fixture
def gpu_recorder(fake_clock):
    from ds_odc.metrics.timing import CudaEventTimer

    gpu = FakeGpu()
    timer = CudaEventTimer("cuda:0", clock=recorder_module._clock, event_factory=gpu.event,
                           current_stream=lambda: "compute", synchronize=lambda: gpu.at.update(compute=gpu.anchor))
    return StepRecorder(rank=0, timer=timer), gpu


def gpu_step(recorder, gpu, clock, offset=0.0, pull=None):
    """The host queues a whole step at one instant; the device runs it over 7.5 s: micro-batch 0-5 with a
    gather stall 1-3 on the compute stream, the optimizer step 5-7.5 with a rendezvous wait 5.5-7; the
    step ends when the host reads the anchor (device time 8, host clock 200 + offset)."""
    def at(t):
        gpu.at["compute"] = offset + t
    at(0.0)
    recorder.begin_micro_batch()
    at(1.0)
    with recorder.span("gather"):
        if pull is not None:
            gpu.at["pull"] = offset + pull[0]
            with recorder.device_span("pull", stream="pull"):
                gpu.at["pull"] = offset + pull[1]
        at(3.0)
    at(5.0)
    recorder.end_micro_batch()
    with recorder.optimizer_step():
        at(5.5)
        with recorder.span("step_wait"):
            at(7.0)
        at(7.5)
        clock.now = 200.0 + offset  # the host reads its clock once the device has reached the anchor
        gpu.anchor = offset + 8.0


def test_cuda_event_timing_reports_device_times_not_host_queueing(fake_clock, gpu_recorder):
    recorder, gpu = gpu_recorder
    gpu_step(recorder, gpu, fake_clock)
    report = recorder.last
    assert report.timing == "cuda-events" and recorder.timing == "cuda-events"
    assert report.start == pytest.approx(192.0)  # anchor: device time 8 is host time 200
    assert report.wall_s == pytest.approx(7.5)
    assert report.compute_s == pytest.approx((3.0,)) and report.gather_s == pytest.approx(2.0)
    assert report.step_wait_s == pytest.approx(1.5) and report.optimizer_s == pytest.approx(1.0)
    assert report.other_s == pytest.approx(0.0)
    kinds = {kind: (start - 192.0, end - 192.0) for kind, start, end in report.events}
    assert kinds["gather"] == pytest.approx((1.0, 3.0)) and kinds["optimizer"] == pytest.approx((5.0, 7.5))


def test_side_stream_spans_are_drawn_not_charged_and_their_overlap_is_measured(fake_clock, gpu_recorder):
    from ds_odc.metrics.overlap import hidden

    recorder, gpu = gpu_recorder
    gpu_step(recorder, gpu, fake_clock, pull=(0.5, 2.5))
    report = recorder.last
    pulls = [(s - report.start, e - report.start) for kind, s, e in report.events if kind == "pull"]
    assert pulls == [pytest.approx((0.5, 2.5))]
    assert report.gather_s == pytest.approx(2.0) and report.compute_s == pytest.approx((3.0,))  # unchanged
    figures = hidden(report, "pull")  # compute is 0-1 and 3-5: only 0.5-1 of the pull is beside it
    assert figures.busy_s == pytest.approx(2.0) and figures.hidden_s == pytest.approx(0.5)
    assert figures.fraction == pytest.approx(0.25)


def test_events_are_reused_from_step_to_step(fake_clock, gpu_recorder):
    recorder, gpu = gpu_recorder
    gpu_step(recorder, gpu, fake_clock)
    first = gpu.created
    for step in range(1, 4):
        gpu_step(recorder, gpu, fake_clock, offset=10.0 * step)
    assert gpu.created == first  # every later step reused the resolved events
    assert [r.wall_s for r in recorder.reports] == pytest.approx([7.5] * 4)
    assert recorder.reports[-1].start == pytest.approx(222.0)


def test_cpu_recorders_time_on_the_host():
    from ds_odc.metrics.timing import HostTimer, timer_for

    assert isinstance(timer_for("cpu", recorder_module._clock), HostTimer)
    assert StepRecorder(rank=0).timing == "host"  # DeepSpeed's accelerator is the CPU here
    assert StepRecorder(rank=0, device="cpu").timing == "host"


def test_overlap_and_report_examples():
    import doctest

    import ds_odc.metrics.overlap
    import ds_odc.metrics.step_report

    for module in (ds_odc.metrics.overlap, ds_odc.metrics.step_report):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__


def test_timeline_plot_draws_side_stream_work(fake_clock, gpu_recorder, tmp_path):
    recorder, gpu = gpu_recorder
    gpu_step(recorder, gpu, fake_clock, pull=(0.5, 2.5))
    path = plot_timelines({"ODC on GPU": [recorder.last]}, str(tmp_path / "gpu.png"))
    with open(path, "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def uneven_step(recorder, gpu, clock, micro_batches):
    """A step whose micro-batches run back to back on the device, the next one's forward closing the last
    (torch-style ``loss.backward()``: one mark ends one micro-batch and starts the next), then 1 s of
    optimizer step. The device clock and the host clock agree here (anchor at device time = host time)."""
    def run(seconds):
        gpu.at["compute"] += seconds
    for seconds in micro_batches:
        recorder.begin_micro_batch()
        run(seconds)
    with recorder.optimizer_step():  # closes the last micro-batch
        run(1.0)
        clock.now = 200.0 + gpu.at["compute"]
        gpu.anchor = gpu.at["compute"]


def test_shared_and_first_marks_resolve_once_and_steps_of_more_marks_stay_right(fake_clock, gpu_recorder):
    """A step's first mark is also a span's start, and one mark ends a micro-batch and
    starts the next. Returned to the free list once per use, one event came back twice: a step with more
    marks than the one before then recorded two live marks on one event (the earlier span took the later
    time) and the free list grew every step."""
    recorder, gpu = gpu_recorder
    timer = recorder._get_timer()
    schedule = [[2.0], [1.0, 3.0, 0.5], [4.0, 1.5], [0.25] * 6, [2.0]] * 4
    free = []
    for micro_batches in schedule:
        uneven_step(recorder, gpu, fake_clock, micro_batches)
        report = recorder.last
        assert report.compute_s == pytest.approx(tuple(micro_batches)), (micro_batches, report.events)
        assert report.wall_s == pytest.approx(sum(micro_batches) + 1.0)
        assert report.optimizer_s == pytest.approx(1.0) and report.other_s == pytest.approx(0.0)
        free.append(len(timer._free))
    assert len({id(event) for event in timer._free}) == len(timer._free), "an event is in the free list twice"
    assert free[-5:] == free[5:10]  # the same schedule again: no growth from step to step
    # the largest step's distinct marks (6 starts, the last end, the optimizer's two) + anchor
    assert max(free) <= 6 + 3 + 1
    total = sum(r.wall_s for r in recorder.reports)
    assert total == pytest.approx(sum(sum(m) + 1.0 for m in schedule))
