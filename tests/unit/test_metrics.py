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
