"""ZeRO-3's API contracts hold on ODC: the same script on ``"stage": 3`` and ``"stage": "odc"``
observes the same values (2 ranks, real engines). Between backward and step the reads are
collective on ODC (a gradient fence), as they are in ZeRO-3; see "ZeRO-3 APIs" in docs/frameworks.md."""
import pytest
import torch

from tests.support import contract_workloads as contracts
from tests.support.compare import assert_close_nested, worst_rel_diff
from tests.support.harness import run_ranks
from tests.support.workloads import make_model, micro_batch, mse_mean, reference_training


def _both(fn, *args):
    return run_ranks(fn, 2, 3, *args), run_ranks(fn, 2, "odc", *args)


def test_shard_writes_right_after_initialize_are_what_every_rank_s_first_forward_uses():
    zero3, odc = _both(contracts.shard_writes_after_initialize)
    assert not torch.allclose(zero3[0], make_model()(micro_batch(0, 0, 0)[0]))  # the writes changed it
    for rank in range(2):
        torch.testing.assert_close(odc[rank], zero3[rank], rtol=0, atol=0)


def test_gradient_reads_between_backward_and_step_equal_zero3():
    zero3, odc = _both(contracts.gradient_reads_before_step, (2, 2))
    for rank in range(2):
        # summation order differs (pushes vs reduce-scatter)
        assert_close_nested(odc[rank], zero3[rank], rtol=1e-5, atol=1e-6)


def test_optimizer_offload_steps_as_zero3_offload_and_reads_as_on_device():
    """``offload_optimizer: cpu``: the step (on the host fp32 copy) equals ZeRO-3's with the same
    offload. Gradient reads before the step equal ODC's on-device ones; ZeRO-3's own reads under
    offload see nothing until its boundary copy (zeros here, with unmanaged accumulation), which
    ODC does not reproduce."""
    offload = {"offload_optimizer": {"device": "cpu"}}
    zero3 = run_ranks(contracts.gradient_reads_before_step, 2, 3, (2, 2), offload)
    odc = run_ranks(contracts.gradient_reads_before_step, 2, "odc", (2, 2), offload)
    on_device = run_ranks(contracts.gradient_reads_before_step, 2, "odc", (2, 2))
    for rank in range(2):
        assert odc[rank]["offload"] and zero3[rank]["offload"] and not on_device[rank]["offload"]
        for key in ("partitions", "full", "local"):
            assert_close_nested(odc[rank][key], on_device[rank][key], rtol=1e-6, atol=1e-7, path=key)
        for key in ("norm", "params"):
            assert_close_nested(odc[rank][key], zero3[rank][key], rtol=1e-5, atol=1e-6, path=key)


def test_gradient_reads_with_different_micro_batch_counts_see_every_rank():
    """Ranks ran 3 and 0 micro-batches (ZeRO-3 cannot): every read is the sum over all of them,
    divided by the world size (ZeRO-3's partition arithmetic), from a single process."""
    odc = run_ranks(contracts.gradient_reads_before_step, 2, "odc", (3, 0))
    model = make_model()
    for index in range(3):
        x, y, _ = micro_batch(0, 0, index)
        mse_mean(model(x), y).backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            for rank in range(2):
                torch.testing.assert_close(odc[rank]["full"][name], param.grad / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backward_after", [True, False], ids=["backward-after", "step-right-after"])
def test_zero_grad_outside_a_step_discards_as_zero3_does(backward_after):
    zero3, odc = _both(contracts.zero_grad_between_backward_and_step, backward_after)
    assert_close_nested(odc[0], zero3[0], rtol=1e-5, atol=1e-6)  # summation order differs (pushes vs reduce-scatter)


def test_writes_through_collective_apis_are_seen_by_the_next_forward_and_step():
    zero3, odc = _both(contracts.collective_writes)
    for rank in range(2):
        # two Adam steps (lr 1e-2) amplify the summation-order differences; the writes move values by > 0.1
        assert_close_nested(odc[rank], zero3[rank], rtol=1e-4, atol=1e-5)


def test_a_non_finite_gradient_on_one_rank_makes_every_rank_skip_that_step_without_a_collective():
    from tests.support.sync_workloads import install_collective_counter
    odc = run_ranks(contracts.overflow_on_one_rank, 2, "odc", setup=install_collective_counter)
    for rank in range(2):
        assert [s["overflow"] for s in odc[rank]] == [True, False], odc
        assert [s["moved"] for s in odc[rank]] == [False, True], odc
        assert [s["collectives"] for s in odc[rank]] == [0, 0], odc  # the norm round decided


def test_coalesce_grad_reduction_changes_nothing_on_odc():
    """Under ``engine.coalesce_grad_reduction()`` ZeRO-3 leaves each backward's gradients on the
    parameters and reduces their compute-dtype (bf16) sum once at the block's exit. ODC has no collective
    to save there: it pushes every backward into the fp32 accumulators as always, so the run equals the
    one without the block exactly (it once pushed the bf16 sum at the exit: 1e-3 away after one Adam step)."""
    plain = run_ranks(contracts.coalesced_reduction, 2, "odc", False)
    coalesced = run_ranks(contracts.coalesced_reduction, 2, "odc", True)
    moved = run_ranks(contracts.coalesced_reduction, 2, "odc", False, 0)
    for rank in range(2):
        assert any(not torch.equal(plain[rank][n], moved[rank][n]) for n in plain[rank])  # the steps trained
        assert_close_nested(coalesced[rank], plain[rank], rtol=0, atol=0)


def test_gradient_norms_read_between_backward_and_step_equal_zero3():
    """``optimizer._get_norm_groups()`` outside a step is answered behind a gradient fence (collective,
    as ZeRO-3's all-reduce is), before and after gradients are rewritten with ``safe_set_local_grad``."""
    zero3, odc = _both(contracts.norm_groups_before_step)
    for rank in range(2):
        assert odc[rank]["clamped"][0] < odc[rank]["before"][0]
        assert_close_nested(odc[rank], zero3[rank], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer_offload", [True, False], ids=["with-optimizer-offload", "parameters-only"])
def test_parameter_offload_steps_as_zero3_with_the_same_offload(optimizer_offload):
    """``offload_param: {"device": "cpu"}``: the shards live in the (host) windows and every step equals
    ZeRO-3's with the same offload."""
    zero3 = run_ranks(contracts.offload_param_training, 2, 3, (2, 2), 3, optimizer_offload)
    odc = run_ranks(contracts.offload_param_training, 2, "odc", (2, 2), 3, optimizer_offload)
    for rank in range(2):
        assert odc[rank]["shards_in_window"] and not zero3[rank]["shards_in_window"]
        for ours, theirs in zip(odc[rank]["params"], zero3[rank]["params"], strict=True):
            assert worst_rel_diff(ours, theirs) <= 1e-6


def test_parameter_offload_with_uneven_counts_equals_one_process():
    odc = run_ranks(contracts.offload_param_training, 2, "odc", (3, 1))
    expected = reference_training("unmanaged", (3, 1))
    for rank in range(2):
        assert worst_rel_diff(odc[rank]["params"][-1], expected) <= 1e-5
