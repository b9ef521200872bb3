"""``engine.offload_states()`` / ``reload_states()`` on the odc stage (RL frameworks call them around every
rollout): training after them is bit for bit the training without them, the windows really leave (their
pages are unmapped), and every misuse is named on every rank within seconds.

Bit for bit needs an order-independent accumulation: pushes from several ranks land in an owner's
accumulator in arrival order, so the fp32 runs have one pushing rank or one micro-batch per rank, and the
bf16 runs, with uneven counts on both ranks, sum in the fp64 accumulator (a few bf16 gradients sum exactly
there)."""
import pytest
import torch

from tests.support.compare import assert_same_run
from tests.support.harness import run_ranks
from tests.support.offload_states_workloads import (
    after_destroy_and_initialize,
    after_empty_partition_cache,
    after_load_module_only,
    misuse,
    offload_round_trip,
    reload_refused_then_retried,
    rollout_round_trip,
    windows_unmapped_while_away,
)

CASES = {
    # the reproduction: DeepSpeed's Adam, every state, between steps
    "fp32-every-state": {"calls": {2: None}},
    # each state on its own and all of them, with gradients pushed before the call (lp_grads must survive),
    # uneven counts and per-token normalisation, bf16
    "bf16-uneven-token-each-state": {
        "counts": (1, 3), "bf16": True, "token": True, "mid_accumulation": True, "steps": 6,
        "odc": {"accumulator_dtype": "fp64"},
        "calls": {1: ["lp_params"], 2: ["lp_grads"], 3: ["hp_params", "optim_states", "contiguous_grad_buffer"],
                  4: None}},
    # rank 1 runs no micro-batch: every owner's accumulator adds rank 0's pushes in program order (fp32 sums
    # from several ranks land in arrival order, which two runs need not share)
    "fp32-uneven-unpinned-non-blocking": {
        "counts": (3, 0), "mid_accumulation": True, "pin_memory": False, "non_blocking": True,
        "calls": {1: None, 3: ["lp_grads", "lp_params"]}},
    # deterministic sums: the accumulator's two regions (coarse and fine) go away and come back together, mid-step
    "deterministic-uneven-token": {
        "counts": (2, 1), "token": True, "mid_accumulation": True, "steps": 4, "odc": {"deterministic": True},
        "calls": {1: ["lp_grads"], 2: None}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_after_offload_and_reload_equals_training_without(case):
    for rank, result in enumerate(run_ranks(offload_round_trip, 2, CASES[case])):
        assert_same_run(result["plain"], result["offloaded"], f"rank {rank}")


def test_policy_and_frozen_reference_offloaded_around_a_rollout():
    """Both engines of an RL step (the frozen one included, which ZeRO-3 refuses to offload) with uneven
    counts: equal to the run without the calls, and both windows were away in between."""
    plain = run_ranks(rollout_round_trip, 2, False)
    offloaded = run_ranks(rollout_round_trip, 2, True)
    for rank in range(2):
        assert offloaded[rank]["away_while_offloaded"] == ["grads", "params"]
        assert_same_run(plain[rank], offloaded[rank], f"rank {rank}")


def test_windows_are_unmapped_while_away_and_no_file_is_left():
    for result in run_ranks(windows_unmapped_while_away, 2):
        windows = lambda names: [n for n in names if n.endswith(("_params", "_grads"))]  # noqa: E731
        assert len(windows(result["before"])) == 4  # both ranks' parameter windows and accumulators
        assert windows(result["away"]) == []
        assert len(windows(result["after"])) == 4 and set(windows(result["after"])).isdisjoint(result["before"])
        assert result["leftovers"] == []


def test_a_pull_while_offloaded_is_named_on_every_rank_within_seconds():
    puller, waiter = run_ranks(misuse, 2, "pull_while_offloaded")
    assert puller["error"] == "ODCStateError" and "reload_states" in puller["message"]
    assert waiter["error"] in ("ODCPeerError", "ODCGroupFailedError") and "rank 0" in waiter["message"]
    assert waiter["seconds"] < 10, "the waiting rank learned of it only at its timeout"
    assert puller["phase"] == waiter["phase"] == "failed"


def test_offload_states_on_one_rank_only_is_named_on_every_rank_within_seconds():
    results = run_ranks(misuse, 2, "one_rank_only")
    for rank, result in enumerate(results):
        assert result["error"] == "ODCPeerError", f"rank {rank}: {result}"
        assert "offload_states" in result["message"] and "engine.step" in result["message"], result["message"]
        assert result["seconds"] < 10


def test_different_states_on_different_ranks_are_refused_on_every_rank():
    for result in run_ranks(misuse, 2, "different_states"):
        assert result["error"] in ("ODCStateError", "ODCPeerError"), result
        assert "parameter window" in result["message"] and "gradient accumulator" in result["message"]


def test_a_rank_that_cannot_reload_is_named_on_every_rank_and_a_retry_trains_on():
    results = run_ranks(reload_refused_then_retried, 2)
    plain = run_ranks(offload_round_trip, 2, {"calls": {}, "steps": 4})
    for rank, result in enumerate(results):
        error, message = result["refused"]
        assert error in ("ODCConfigError", "ODCStateError"), result["refused"]
        assert ("no room for rank 1's" in message) if rank == 1 else ("rank(s) [1]" in message), message
        assert result["away_after_refusal"] == ["grads", "params"]
        assert_same_run(plain[rank]["plain"], result, f"rank {rank}")


# -- the other calls that replace or move ZeRO-3's partitioned buffers after initialize ------------------
def test_offload_states_with_the_optimizer_offloaded_trains_on_as_without():
    """offload_optimizer (DeepSpeed's static optimizer offload, whose refresh of host buffers at the step
    reads the accumulator): every state the engine lets move, moved and back."""
    case = {"counts": (2, 0), "mid_accumulation": True,
            "zero": {"offload_optimizer": {"device": "cpu"}}, "calls": {1: None, 2: ["lp_params"]}}
    for rank, result in enumerate(run_ranks(offload_round_trip, 2, case)):
        assert_same_run(result["plain"], result["offloaded"], f"rank {rank}")


def test_empty_partition_cache_keeps_training_and_frozen_forwards_as_without():
    plain = run_ranks(after_empty_partition_cache, 2, False)
    called = run_ranks(after_empty_partition_cache, 2, True)
    for rank in range(2):
        assert_same_run(plain[rank], called[rank], f"rank {rank}")
        assert all(torch.equal(a, b) for a, b in zip(plain[rank]["reference"], called[rank]["reference"]))


def test_an_engine_after_another_was_destroyed_trains_as_the_only_one():
    alone = run_ranks(after_destroy_and_initialize, 2, False)
    second = run_ranks(after_destroy_and_initialize, 2, True)
    for rank in range(2):
        assert_same_run(alone[rank], second[rank], f"rank {rank}")


def test_load_checkpoint_module_only_trains_on_as_zero3(tmp_path):
    """A warm start from a checkpoint's weights: the loaded weights and the steps after equal ZeRO-3's doing
    the same (its rounding: one micro-batch per rank, so the sums are order-free)."""
    odc = run_ranks(after_load_module_only, 2, "odc", str(tmp_path / "odc"))
    zero3 = run_ranks(after_load_module_only, 2, 3, str(tmp_path / "zero3"))
    for rank in range(2):
        assert odc[rank]["losses"] == pytest.approx(zero3[rank]["losses"], rel=1e-6)
        for step, (a, b) in enumerate(zip(odc[rank]["params"], zero3[rank]["params"])):
            for name in a:
                assert torch.allclose(a[name], b[name], rtol=1e-6, atol=1e-7), f"rank {rank} step {step}: {name}"
