"""Gradients read, written or dropped between backward and step while a faster peer runs its next micro-batch,
forced on a quiet machine (the protocol points of ``ds_odc.comm.schedule``), against ZeRO-3 running the same
script in the only order its collectives allow.

The first case is DeepSpeed's ``test_param_persistence_threshold`` under load, made deterministic: what
``get_fp32_grad_partitions()`` and ``safe_get_local_grad()`` handed the slower rank was a live view of its
accumulator, and moved when the faster rank pushed its next micro-batch ([Note: reads are snapshots]).
"""
import pytest
import torch

from tests.support import interleaving_workloads as interleavings
from tests.support.compare import assert_close_nested
from tests.support.harness import run_ranks

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}  # summation order differs (pushes vs reduce-scatter)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario once on ZeRO-3 and once on ODC with the faster peer forced ahead (one launch each)."""
    base = tmp_path_factory.mktemp("interleavings")
    signals = base / "signals"
    signals.mkdir()
    calls = interleavings.SCENARIOS
    zero3 = run_ranks(interleavings.interleavings, 2, 3, calls, False, str(signals), str(base / "zero3"))
    odc = run_ranks(interleavings.interleavings, 2, "odc", calls, True, str(signals), str(base / "odc"))
    return zero3, odc


@pytest.mark.parametrize("call", interleavings.READS)
def test_what_a_read_handed_the_slower_rank_does_not_move_when_the_faster_rank_pushes_on(runs, call):
    zero3, odc = runs
    reader = odc[interleavings.READER][call]
    for index, (handed, still) in enumerate(zip(reader["handed"], reader["still"])):
        torch.testing.assert_close(still, handed, rtol=0, atol=0, msg=lambda m, i=index: f"{call}[{i}]: {m}")
    for rank in range(2):
        assert_close_nested(odc[rank][call]["handed"], zero3[rank][call]["handed"], path=f"{call} handed",
                            **TOLERANCE)
        for key in ("grads", "params"):
            assert_close_nested(odc[rank][call][key], zero3[rank][call][key], path=f"{call} {key}", **TOLERANCE)


@pytest.mark.parametrize("call", interleavings.WRITES)
def test_a_write_racing_the_faster_rank_s_push_loses_neither(runs, call):
    """Rank 1 writes a gradient after rank 0's next micro-batch has landed in its accumulator: the step sees
    the write and that micro-batch, as ZeRO-3 (write, then both ranks' micro-batch 1) does."""
    zero3, odc = runs
    for rank in range(2):
        assert not odc[rank][call]["pending"], odc[rank][call]["pending"]  # every forced hold happened
        for key in ("grads", "params"):
            assert_close_nested(odc[rank][call][key], zero3[rank][call][key], path=f"{call} {key}", **TOLERANCE)


@pytest.mark.parametrize("call", interleavings.DROPS)
def test_a_faster_rank_cannot_overtake_a_collective_call_that_drops_or_moves_gradients(runs, call):
    """Rank 1 waits inside the call (before its accumulator is zeroed, its checkpoint written, its windows
    moved) while rank 0 tries to run its next micro-batch: no push lands during the wait, and the step equals
    ZeRO-3's (offload_states: the run without it, which ZeRO-3 is on every other count)."""
    zero3, odc = runs
    reader = odc[interleavings.READER][call]
    [(point, signal, seconds)] = reader["held"]
    assert signal == "" and seconds >= interleavings.PAUSE_S * 0.9, reader["held"]  # the pause ran out
    for rank in range(2):
        for key in ("grads", "params"):
            assert_close_nested(odc[rank][call][key], zero3[rank][call][key], path=f"{call} {key}", **TOLERANCE)
