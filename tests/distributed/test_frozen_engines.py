"""Engines without an optimizer (reference and reward models) on the odc stage: their gathers are
one-sided pulls, so ranks may call them different numbers of times (DPO, KTO, GRPO with a KL term, PPO
with balanced micro-batches), with parameters released after every use as for any model of real size.
On ZeRO-3 that shape hangs: one rank waits in the reference model's all-gather, its peer at the step."""
import pytest
import torch

from tests.support.compare import worst_rel_diff
from tests.support.frozen_workloads import frozen_forwards, policy_with_reference, policy_with_reference_reference
from tests.support.harness import run_ranks
from tests.support.workloads import make_model, micro_batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_frozen_engine_gives_zero3_s_outputs_bit_for_bit(dtype):
    zero3 = run_ranks(frozen_forwards, 2, 3, (2, 2), dtype)
    odc = run_ranks(frozen_forwards, 2, "odc", (2, 2), dtype)
    for rank in range(2):
        assert odc[rank]["engine"] == "ODCEngine" and odc[rank]["pulls"] > 0
        assert zero3[rank]["pulls"] is None  # ZeRO-3's engine has no runtime
        for ours, theirs in zip(odc[rank]["outputs"], zero3[rank]["outputs"], strict=True):
            assert torch.equal(ours, theirs)


def test_ranks_call_a_frozen_engine_different_numbers_of_times_with_released_parameters():
    """3 forwards on rank 0, 1 on rank 1, none of them meeting the other rank; each output is the plain
    model's on the same input. The window holds every frozen shard of this rank (no accumulator)."""
    odc = run_ranks(frozen_forwards, 2, "odc", (3, 1), timeout=120)
    model = make_model()
    with torch.no_grad():
        expected = [model(micro_batch(0, 0, index)[0]) for index in range(3)]
    for rank, count in enumerate((3, 1)):
        assert len(odc[rank]["outputs"]) == count
        for ours, reference in zip(odc[rank]["outputs"], expected):
            torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    shard = lambda numel: -(-numel // 2)  # noqa: E731 - ZeRO-3's padded partition
    assert odc[0]["window"] == (sum(shard(p.numel()) for p in model.parameters()),)
    assert all(result["shard_private"] for result in odc)  # destroy() copied the shards out of the window


def test_a_policy_with_a_frozen_reference_trains_with_uneven_counts_as_one_process_does():
    """The reference-model hang, fixed: rank 0 runs 3 micro-batches per step, rank 1 runs 1, each calling the
    frozen reference model before the policy; every step equals one process on the same global batch."""
    counts = (3, 1)
    odc = run_ranks(policy_with_reference, 2, "odc", counts, timeout=180)
    expected = policy_with_reference_reference(counts)
    for rank in range(2):
        for step, (ours, theirs) in enumerate(zip(odc[rank], expected, strict=True)):
            assert worst_rel_diff(ours, theirs) <= 1e-5, f"rank {rank}, step {step}"
