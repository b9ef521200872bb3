"""Checkpoints keep ZeRO-3's layout: round trip, resume, and zero_to_fp32 consolidation."""
from tests.support.compare import worst_rel_diff
from tests.support.harness import run_ranks
from tests.support.workloads import checkpoint_roundtrip, modify_under_gathered_parameters


def test_checkpoint_round_trip_resume_and_zero_to_fp32(tmp_path):
    results = run_ranks(checkpoint_roundtrip, 2, str(tmp_path / "ckpt"))
    rank0 = results[0]
    assert rank0["engine"] == "ODCEngine"
    assert worst_rel_diff(rank0["loaded"], rank0["saved"]) == 0.0
    for rank, result in enumerate(results):
        assert result["resumed"] == result["continued"], f"rank {rank}: losses after resume differ"
    assert worst_rel_diff(rank0["resumed_final"], rank0["final"]) == 0.0
    consolidated = rank0["zero_to_fp32"]
    trainable = {k: v for k, v in rank0["saved"].items() if k in consolidated}
    assert set(trainable) >= {"inp.weight", "inp.bias", "out.weight", "blocks.0.weight"}
    assert worst_rel_diff({k: consolidated[k] for k in trainable}, trainable) == 0.0


def test_gathered_parameters_modify_and_gather_after_destroy():
    """A modification under GatheredParameters(modifier_rank=0) reaches every rank; after
    engine.destroy() the model is still gatherable (by ZeRO-3's collectives) with the trained weights."""
    results = run_ranks(modify_under_gathered_parameters, 2)
    for rank, result in enumerate(results):
        assert (result["seen"] == 0.5).all(), f"rank {rank} pulled a stale weight"
        assert (result["after_destroy"] == result["before_destroy"]).all(), f"rank {rank}"
    assert results[0]["loss"] == results[1]["loss"]
