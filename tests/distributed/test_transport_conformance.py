"""The Transport contract, one suite for every transport (``tests/support/transports.py``), with
real processes. shm runs everywhere; cuda_ipc runs where a CUDA device exists and is skipped, with the
reason, elsewhere (GPU ranks share GPU 0 when there are fewer GPUs than ranks)."""
import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.transport_workloads import (
    PULL_DTYPES,
    PULL_LENGTHS,
    PULL_OFFSETS,
    concurrent_accumulate,
    expected_accumulation,
    large_misaligned_push,
    push_holder_dies,
    pusher_killed,
    reads_and_exchanges,
    window_values,
)
from tests.support.transports import CASES, TRANSPORTS, rank_env


@pytest.mark.parametrize("name", TRANSPORTS)
def test_reads_of_every_dtype_and_offset_see_owner_windows_and_exchange_returns_every_row(name):
    world = 3
    results = run_ranks(reads_and_exchanges, world, name, env=rank_env(name, world))
    windows = {dtype: [window_values(4096, dtype, owner) for owner in range(world)] for dtype in PULL_DTYPES}
    for result in results:
        assert result["kinds"] == sorted((name, CASES[name].device_type, str(d)) for d in PULL_DTYPES)
        assert result["rows"] == [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]
        assert result["rounds"] == [3 * i for i in range(5)]
        # every read twice: one at a time, then all of them in one read_many
        assert len(result["seen"]) == 2 * len(PULL_DTYPES) * world * len(PULL_OFFSETS) * len(PULL_LENGTHS)
        for key, values in result["seen"].items():
            dtype, owner, offset, length = key[-4:]
            window = windows[getattr(torch, dtype.split(".")[1])][owner]
            assert torch.equal(values, window[offset:offset + length]), (dtype, owner, offset, length)


@pytest.mark.parametrize("batch", [1, 7], ids=["one-by-one", "accumulate_many"])
@pytest.mark.parametrize("accumulator", ["fp32", "fp64"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_concurrent_pushes_into_one_owner_are_exact_sums(name, accumulator, batch):
    world = 4
    results = run_ranks(concurrent_accumulate, world, name, accumulator, 200, batch, env=rank_env(name, world))
    for owner, (actual, expected) in enumerate(zip(results, expected_accumulation(world))):
        assert actual.dtype == {"fp32": torch.float32, "fp64": torch.float64}[accumulator]
        # adds in arrival order: equal up to rounding, never a lost update (those are O(1))
        assert torch.allclose(actual.double(), expected, atol=1e-4, rtol=1e-5), f"owner {owner}"


@pytest.mark.parametrize("name", TRANSPORTS)
def test_large_misaligned_push_adds_every_element_once(name):
    world, numel = 2, 3_000_001
    owner = run_ranks(large_misaligned_push, world, name, numel, env=rank_env(name, world))[0]
    expected = 2.0 * sum(r + 1 for r in range(world))  # fp32 and bf16 push of rank + 1 from every rank
    assert owner[0].item() == 0.0 and owner[numel + 1:].abs().sum().item() == 0.0  # nothing outside the range
    assert torch.equal(owner[1:numel + 1], torch.full((numel,), expected))


@pytest.mark.parametrize("name", TRANSPORTS)
def test_dead_pusher_is_named_at_the_fence(name):
    report = run_ranks(pusher_killed, 2, name, report=True, wait_for=[0], timeout=90, env=rank_env(name, 2))
    status, outcome = report.outcomes[0]
    assert status == "ok", outcome
    assert outcome["error"] == "ODCPeerError" and "rank 1" in outcome["message"], outcome
    assert outcome["waited_s"] < 5.0, outcome  # a dead peer is reported at once, not after the timeout


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_pusher_killed_inside_its_push_never_blocks_other_pushers(name):
    report = run_ranks(push_holder_dies, 2, name, report=True, wait_for=[0], timeout=60, env=rank_env(name, 2))
    status, outcome = report.outcomes[0]
    assert status == "ok", outcome
    assert outcome["sum"] == 10.0 and outcome["waited_s"] < 5.0, outcome  # 5 s: the transport's timeout
    if CASES[name].exclusive_pushes:  # the guard really held: the push waited for the holder's death (1 s)
        assert outcome["waited_s"] > 0.5, outcome
