"""The figures a monitor shows (ds_odc.metrics.figures), the plan-gap warning, and what the recorder adds for them:
counters, measured spans, the fence's counts, the plan, a pause."""
import doctest
import os
import re

import pytest

import ds_odc.metrics.figures
import ds_odc.metrics.plan_gap
import ds_odc.metrics.recorder as recorder_module
from ds_odc.metrics import PlannedStep, StepRecorder, StepReport, planned_step
from ds_odc.metrics.figures import MEANINGS, PREFIX, UNKNOWN, Window, fields_for, figures, rank_row
from ds_odc.metrics.plan_gap import PlanGap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("module", [ds_odc.metrics.figures, ds_odc.metrics.plan_gap])
def test_docstring_examples(module):
    failures, tried = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert tried and not failures


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(recorder_module, "clock", fake)
    return fake


def report(rank, step=0, compute=(1.0,), wall=4.0, counters=(), fenced=(), plan=None, fence=0.5):
    return StepReport(rank=rank, step=step, start=0.0, wall_s=wall, compute_s=tuple(compute), gather_s=0.25,
                      reduce_s=0.125, step_wait_s=fence, optimizer_s=0.5, counters=tuple(counters),
                      all_micro_batches=tuple(fenced), plan=plan)


# -- the recorder's additions --------------------------------------------------------------------------------------
def test_counters_measured_spans_the_fence_and_the_plan_reach_the_report_and_a_pause_records_nothing(clock):
    recorder = StepRecorder(rank=0)
    recorder.begin_micro_batch()
    recorder.count("tokens", 7)
    with recorder.measure("split"):
        clock.now += 2.0
    recorder.end_micro_batch()
    with recorder.paused():
        recorder.count("tokens", 1000)
        with recorder.span("step_wait"):
            clock.now += 5.0
    recorder.note_plan(PlannedStep((1.0, 2.0), 2.0))
    with recorder.optimizer_step():
        with recorder.measure("cross_node"):
            clock.now += 0.5
        recorder.count("tokens", 3)
        recorder.note_micro_batches([1, 3])
    last = recorder.last
    assert last.counters == (("cross_node_s", 0.5), ("split_s", 2.0), ("tokens", 10.0))
    assert last.counter("tokens") == 10.0 and last.counter("pull_bytes") == 0.0 and not last.has_counter("pull_bytes")
    assert [kind for kind, _, _ in last.events] == ["micro_batch", "optimizer"]  # measured spans are not drawn
    assert last.step_wait_s == 0.0  # the paused span was not charged
    assert last.all_micro_batches == (1, 3) and last.plan == PlannedStep((1.0, 2.0), 2.0)
    assert recorder.enabled
    with recorder.optimizer_step():  # the next step starts empty
        pass
    assert recorder.last.counters == () and recorder.last.plan is None and recorder.last.all_micro_batches == ()


def test_a_disabled_recorder_counts_nothing(clock):
    recorder = StepRecorder(rank=0)
    recorder.enabled = False
    recorder.count("tokens", 3)
    recorder.note_plan(PlannedStep((1.0,), 1.0))
    with recorder.measure("split"), recorder.optimizer_step():
        pass
    assert recorder.last is None


# -- rows and figures ----------------------------------------------------------------------------------------------
def test_a_row_holds_each_field_per_step_over_the_window():
    window = [report(0, compute=(1.0, 2.0), counters=[("tokens", 8), ("push_bytes", 100)]),
              report(0, step=1, compute=(3.0,), counters=[("tokens", 2), ("push_bytes", 300)])]
    names = ["utilisation", "compute_s", "tokens", "micro_batches", "push_bytes", "pull_bytes"]
    row = dict(zip(names, rank_row(window, names)))
    assert row["utilisation"] == pytest.approx((3.5 + 3.5) / 8.0)  # busy over wall, summed over the window
    assert row["compute_s"] == 3.0 and row["tokens"] == 5.0 and row["micro_batches"] == 1.5
    assert row["push_bytes"] == 200.0
    assert row["pull_bytes"] == UNKNOWN  # never counted in the window
    with pytest.raises(ValueError):
        rank_row([], names)


def test_the_common_fields_of_an_odc_job_fit_one_exchange_round():
    from ds_odc.runtime.core import VALUES_WIDTH

    assert len(fields_for(fenced=True)) <= VALUES_WIDTH
    assert "micro_batches" not in fields_for(fenced=True) and "micro_batches" in fields_for(fenced=False)
    assert fields_for(fenced=False, bytes_counted=False)[:5] == ["utilisation", "compute_s", "pull_s", "push_s",
                                                                  "fence_s"]
    every = fields_for(fenced=True, cross_node=True, split=True, offload=True)
    assert len(every) == len(set(every)) and set(every) <= set(ds_odc.metrics.figures.FIELDS)


def _columns(reports_by_rank, names):
    rows = [rank_row(reports, names) for reports in reports_by_rank]
    return {name: [row[i] for row in rows] for i, name in enumerate(names)}


def test_figures_of_uneven_ranks_and_a_plan():
    plan = PlannedStep((1.0, 3.0), 3.0)
    mine = [report(0, compute=(1.0,), fenced=(1, 3), plan=plan, counters=[("tokens", 4), ("pull_bytes", 10),
                                                                         ("push_bytes", 5)], fence=2.0)]
    theirs = [report(1, compute=(1.0, 1.0, 1.0), fenced=(1, 3), plan=plan, counters=[("tokens", 12),
                                                                                    ("pull_bytes", 10),
                                                                                    ("push_bytes", 15)], fence=0.25)]
    names = fields_for(fenced=True)
    shown = figures(_columns([mine, theirs], names), mine)
    assert shown[PREFIX + "micro_batches/min"] == 1 and shown[PREFIX + "micro_batches/max"] == 3  # from the fence
    assert shown[PREFIX + "tokens/min"] == 4 and shown[PREFIX + "tokens/max"] == 12
    assert shown[PREFIX + "utilisation/min"] == pytest.approx(1.5 / 4) and \
        shown[PREFIX + "utilisation/mean"] == pytest.approx((1.5 + 3.5) / 8)
    assert shown[PREFIX + "idle_fraction"] == pytest.approx(1 - (1.5 + 3.5) / 8)
    assert shown[PREFIX + "balance"] == pytest.approx(2 / 3) and shown[PREFIX + "plan/balance"] == pytest.approx(2 / 3)
    assert shown[PREFIX + "plan/step_cost"] == 3.0 and shown[PREFIX + "step_s"] == 4.0
    assert shown[PREFIX + "fence_wait/max_s"] == 2.0 and shown[PREFIX + "fence_wait/mean_s"] == 1.125
    assert shown[PREFIX + "push/max_bytes"] == 15 and shown[PREFIX + "push/mean_bytes"] == 10
    assert shown[PREFIX + "compute/max_s"] == 3.0 and shown[PREFIX + "compute/mean_s"] == 2.0
    assert set(shown) <= {PREFIX + name for name in MEANINGS}


def test_without_a_plan_or_a_measure_its_figures_are_left_out():
    names = fields_for(fenced=False, bytes_counted=False)
    ranks = [[report(r, compute=(1.0,) * (r + 1))] for r in range(2)]  # no tokens counted, no plan, no fence
    shown = figures(_columns(ranks, names), ranks[0])
    assert not any(name.startswith(PREFIX + "plan/") or "bytes" in name or "tokens" in name for name in shown)
    assert shown[PREFIX + "micro_batches/min"] == 1 and shown[PREFIX + "micro_batches/max"] == 2  # from the rows
    # a window where only some steps had a plan compares nothing
    partial = [report(0, plan=PlannedStep((1.0, 1.0), 1.0)), report(0, step=1)]
    assert ds_odc.metrics.figures.planned(partial) is None


def test_the_planned_balance_of_a_window_is_that_of_its_summed_costs():
    window = [report(0, plan=PlannedStep((1.0, 3.0), 3.0)), report(0, step=1, plan=PlannedStep((3.0, 1.0), 3.0))]
    assert ds_odc.metrics.figures.planned(window) == (1.0, 3.0)


def test_a_window_takes_each_step_once_and_restarts_with_a_new_recorder(clock):
    recorder, window = StepRecorder(rank=0, history=3), Window()
    assert window.take(recorder) == []
    for _ in range(2):
        with recorder.optimizer_step():
            pass
    assert [r.step for r in window.take(recorder)] == [0, 1]
    assert window.take(recorder) == []
    for _ in range(5):  # more than the history keeps: the window holds what is left
        with recorder.optimizer_step():
            pass
    assert [r.step for r in window.take(recorder)] == [4, 5, 6]
    fresh = StepRecorder(rank=0)
    with fresh.optimizer_step():
        pass
    assert [r.step for r in window.take(fresh)] == [0]


def test_a_plan_of_any_form_gives_its_rank_costs_and_step_cost():
    from ds_odc.balance import plan_minibatch
    from ds_odc.balance.slots import StepHeader

    plan = plan_minibatch([900, 100, 100, 100, 500, 300, 700], world_size=2, token_cap=1000)
    assert planned_step(plan) == PlannedStep(tuple(plan.rank_costs()), plan.odc_step_cost())
    header = StepHeader(3, (2, 1), (5.0, 4.0), 7, odc_cost=5.0, collective_cost=6.0)
    assert planned_step(header) == PlannedStep((5.0, 4.0), 5.0)
    assert planned_step(header).balance == pytest.approx(header.planned_utilisation)


def test_every_figure_is_documented_in_docs_metrics():
    with open(os.path.join(ROOT, "docs", "metrics.md")) as page:
        text = page.read()
    documented = set(re.findall(r"`ODC/([a-z_/]+)`", text))
    assert set(MEANINGS) <= documented, sorted(set(MEANINGS) - documented)
    assert documented <= set(MEANINGS), sorted(documented - set(MEANINGS))


# -- the plan-gap warning ----------------------------------------------------------------------------------------
def test_a_persistent_gap_warns_once_naming_what_to_do():
    gap = PlanGap()
    messages = [m for m in (gap.observe(0.95, 0.55) for _ in range(20)) if m is not None]
    assert len(messages) == 1 and gap.warnings == 1
    assert "cost_model" in messages[0] and '"measure"' in messages[0] and "0.55" in messages[0]


def test_noise_does_not_warn():
    gap = PlanGap()
    noisy = [0.5, 0.94, 0.5, 0.5, 0.93, 0.4, 0.9, 0.5, 0.5, 0.95] * 10  # gaps, never three writes in a row
    assert all(gap.observe(0.95, measured) is None for measured in noisy)
    assert all(gap.observe(0.95, 0.85) is None for _ in range(10))  # a lasting small gap: not "well below"


def test_a_lasting_gap_comes_back_rarely_and_a_closed_one_rearms():
    gap = PlanGap(persist=3, repeat_after=100)
    fired = [i for i in range(250) if gap.observe(1.0, 0.5) is not None]
    assert fired == [2, 102, 202]
    gap.observe(1.0, 1.0)  # the gap closes
    assert [i for i in range(5) if gap.observe(1.0, 0.5) is not None] == [2]
