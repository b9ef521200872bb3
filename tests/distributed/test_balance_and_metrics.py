"""Balanced plans drive real engines; the step recorder says where each rank's time went."""
import pytest

from tests.support.balance_workloads import reference_balanced, straggler_timeline, train_balanced
from tests.support.compare import worst_rel_diff
from tests.support.harness import run_ranks


def test_lb_mini_uneven_micro_batches_equal_the_single_process_reference():
    results = run_ranks(train_balanced, 2, "lb-mini")
    first, second = results
    assert first["plans"] == second["plans"]  # every rank planned the same epoch on its own
    assert first["counts"] != second["counts"], "the plan was meant to give ranks different micro-batch counts"
    expected = reference_balanced(first["members"])
    for rank, result in enumerate(results):
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= 1e-6, f"rank {rank}: params differ from the single-process reference by {diff:.2e}"


def test_step_reports_show_where_the_straggler_makes_others_wait():
    """Rank 1 sleeps 0.6 s per forward. Under ZeRO-3 rank 0 waits inside forward/backward (in the
    gathers); under ODC it computes undisturbed and waits once, at the step."""
    sleep = 0.6
    zero3 = run_ranks(straggler_timeline, 2, 3, sleep)
    odc = run_ranks(straggler_timeline, 2, "odc", sleep)
    fast_zero3, fast_odc = zero3[0]["report"], odc[0]["report"]
    slow_odc = odc[1]["report"]
    assert fast_zero3.gather_s + fast_zero3.reduce_s >= 0.5 * sleep, fast_zero3
    assert fast_odc.gather_s + fast_odc.reduce_s < 0.5 * sleep, fast_odc
    assert fast_odc.step_wait_s >= 0.5 * sleep, fast_odc
    assert slow_odc.step_wait_s < fast_odc.step_wait_s
    assert sum(slow_odc.compute_s) >= sleep
    for report in (fast_zero3, fast_odc, slow_odc):
        assert report.micro_batches == 1 and 0.0 < report.utilisation <= 1.0
        parts = sum(report.compute_s) + report.gather_s + report.reduce_s + report.step_wait_s + report.optimizer_s
        assert parts <= report.wall_s * (1 + 1e-9)


def test_uneven_counts_are_recorded_logged_and_metrics_can_be_switched_off():
    on = run_ranks(straggler_timeline, 2, "odc", 0.0, (1, 3), True, 3, 2)  # 3 steps, a log line every 2
    assert [r["report"].micro_batches for r in on] == [1, 3]
    assert [r["steps_recorded"] for r in on] == [3, 3]
    for rank, result in enumerate(on):
        assert [line.split(" | ")[0] for line in result["log_lines"]] == \
            [f"odc metrics: step 0 rank {rank}", f"odc metrics: step 2 rank {rank}"]
    off = run_ranks(straggler_timeline, 2, "odc", 0.0, (1, 3), False)
    assert [r["report"] for r in off] == [None, None]


@pytest.mark.parametrize("policy", ["lb-micro", "local-sort"])
def test_other_policies_train_the_same_samples(policy):
    results = run_ranks(train_balanced, 2, policy)
    assert results[0]["counts"] == results[1]["counts"]  # equal micro-batch counts: what ZeRO-3 needs
    expected = reference_balanced(results[0]["members"])
    assert worst_rel_diff(results[0]["params"], expected) <= 1e-6
