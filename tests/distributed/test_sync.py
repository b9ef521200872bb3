"""The synchronisation contract: no collective in forward/backward, a constant number per step,
and a slow rank does not slow the others' forward/backward."""
from tests.support.harness import run_ranks
from tests.support.sync_workloads import count_collectives, install_collective_counter, straggler


def _counts(stage, layers, micro_batches):
    return run_ranks(count_collectives, 2, stage, layers, micro_batches, setup=install_collective_counter)


def test_no_collectives_in_forward_backward_and_constant_per_step():
    small = _counts("odc", 2, 2)
    large = _counts("odc", 4, 4)  # twice the layers, twice the micro-batches
    for per_rank, micro_batches in zip(small + large, (2, 2, 4, 4)):
        assert per_rank["fwd_bwd"] == [0, 0, 0], per_rank
        # fence, norm, publish; once per engine, the open round before the first pull (ds_odc.runtime.step)
        assert per_rank["exchanges"] == [1 + 3, 3, 3], per_rank
        # one push per trainable parameter per micro-batch; every parameter pulled at least once per
        # micro-batch (persistence is off here), the same number each step once the trace is recorded
        assert per_rank["pushes"] == [per_rank["trainable_params"] * micro_batches] * 3, per_rank
        assert per_rank["pulls"][1] == per_rank["pulls"][2], per_rank
        assert per_rank["pulls"][1] % micro_batches == 0, per_rank
        assert per_rank["pulls"][1] >= per_rank["params"] * micro_batches, per_rank
    assert small[0]["step"] == large[0]["step"], (small[0], large[0])
    assert max(small[0]["step"]) == 0  # the step synchronises through the transport only


def test_zero3_issues_collectives_inside_forward_backward():
    """The contrast the counting test is about: ZeRO-3 synchronises per layer and per micro-batch."""
    zero3 = _counts(3, 2, 2)
    assert all(n > 0 for n in zero3[0]["fwd_bwd"]), zero3[0]


def test_straggler_does_not_slow_the_other_ranks_compute():
    sleep_s, micro_batches, steps = 1.0, 2, 2
    slept = sleep_s * micro_batches * steps
    odc_fast, _ = run_ranks(straggler, 2, "odc", sleep_s, micro_batches, steps)
    zero3_fast, _ = run_ranks(straggler, 2, 3, sleep_s, micro_batches, steps)
    # ODC: rank 0 computes at its own pace and waits only at the step
    assert odc_fast["compute_s"] < 0.25 * slept, odc_fast
    assert odc_fast["step_s"] > 0.5 * slept, odc_fast
    # ZeRO-3: rank 0's forward/backward absorbs the straggler's sleep (per-layer collectives)
    assert zero3_fast["compute_s"] > 0.5 * slept, zero3_fast
