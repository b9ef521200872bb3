"""The Transport contract on the cuda_ipc transport: the shm conformance checks, on GPU windows.

Skipped without CUDA. Ranks share GPU 0 when there are fewer GPUs than ranks (CUDA IPC allows it)."""
import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.transport_workloads import expected_accumulation
from tests.gpu.cuda_workloads import (concurrent_accumulate, gpu_env, large_misaligned_push, pusher_killed,
                                      reads_and_exchanges)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_auto_picks_cuda_ipc_and_reads_see_owner_windows():
    results = run_ranks(reads_and_exchanges, 3, "auto", env=gpu_env(3))
    for result in results:
        assert result["name"] == "cuda_ipc" and result["window_device"].startswith("cuda")
        assert result["rows"] == [[0.0, 1.0], [1.0, 1.0], [2.0, 1.0]]
        for owner, values in enumerate(result["seen"]):
            assert values == (torch.arange(100, 116, dtype=torch.float32) + owner).to(torch.bfloat16).float().tolist()
        assert result["rounds"] == [3 * i for i in range(5)]


@pytest.mark.parametrize("accumulator", ["fp32", "fp64"])
def test_concurrent_pushes_into_one_owner_are_exact_sums(accumulator):
    world = 4
    results = run_ranks(concurrent_accumulate, world, accumulator, env=gpu_env(world))
    for owner, (actual, expected) in enumerate(zip(results, expected_accumulation(world))):
        assert actual.dtype == {"fp32": torch.float32, "fp64": torch.float64}[accumulator]
        # atomic adds in arrival order: equal up to fp32 rounding, never a lost update (those are O(1))
        assert torch.allclose(actual.float(), expected, atol=1e-4, rtol=1e-5), f"owner {owner}"


def test_large_misaligned_push_adds_every_element_once():
    world, numel = 2, 3_000_001
    owner = run_ranks(large_misaligned_push, world, numel, env=gpu_env(world))[0]
    expected = 2.0 * sum(r + 1 for r in range(world))  # fp32 and bf16 push of rank + 1 from every rank
    assert owner[0].item() == 0.0 and owner[numel + 1:].abs().sum().item() == 0.0  # nothing outside the range
    assert torch.equal(owner[1:numel + 1], torch.full((numel,), expected))


def test_dead_pusher_is_named_at_the_fence():
    report = run_ranks(pusher_killed, 2, report=True, wait_for=[0], timeout=90, env=gpu_env(2))
    status, outcome = report.outcomes[0]
    assert status == "ok", outcome
    assert outcome["error"] == "ODCPeerError" and "rank 1" in outcome["message"], outcome
    assert outcome["waited_s"] < 5.0, outcome  # a dead peer is reported at once, not after the timeout
