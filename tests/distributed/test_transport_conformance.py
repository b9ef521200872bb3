"""The Transport contract, checked against every CPU-capable transport with real processes."""
import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.transport_workloads import (concurrent_accumulate, expected_accumulation, lock_holder_dies,
                                                    reads_and_exchanges)

TRANSPORTS = ["shm"]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_reads_see_owner_windows_and_exchange_returns_every_row(name):
    results = run_ranks(reads_and_exchanges, 3, name)
    for result in results:
        assert result["rows"] == [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]
        for owner, values in enumerate(result["seen"]):
            assert values == (torch.arange(100, 116, dtype=torch.float32) + owner).to(torch.bfloat16).float().tolist()
        assert result["rounds"] == [3 * i for i in range(5)]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_concurrent_pushes_into_one_owner_are_exact_sums(name):
    world = 4
    results = run_ranks(concurrent_accumulate, world, name)
    for owner, (actual, expected) in enumerate(zip(results, expected_accumulation(world))):
        # fp32 adds in a different order: equal up to rounding, never a lost update (those are O(1))
        assert torch.allclose(actual, expected, atol=1e-4, rtol=1e-5), f"owner {owner}"


@pytest.mark.parametrize("name", TRANSPORTS)
def test_lock_released_when_its_holder_is_killed(name):
    report = run_ranks(lock_holder_dies, 2, name, report=True, wait_for=[0], timeout=60)
    status, outcome = report.outcomes[0]
    assert status == "ok", outcome
    assert outcome["sum"] == 10.0 and outcome["waited_s"] < 5.0, outcome
