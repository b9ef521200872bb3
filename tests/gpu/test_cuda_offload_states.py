"""``engine.offload_states()`` / ``reload_states()`` on the ``cuda_ipc`` transport: the windows' device memory
returns to the device while they are away (a rollout engine can use it), every peer maps the new windows
after reload, and training after the two calls is bit for bit the training without them. The CPU suite
checks the same protocol on ``shm`` (tests/distributed/test_offload_states.py). Skipped without CUDA."""
import pytest
import torch

from tests.support.harness import run_ranks
from tests.support.offload_states_workloads import device_memory_while_away, offload_round_trip
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env

CASE = gpu_suite_case()
pytestmark = gpu_suite_skip()


def test_training_after_offload_and_reload_on_the_gpu_equals_training_without():
    case = {"transport": CASE.name, "counts": (1, 3), "bf16": True, "token": True, "mid_accumulation": True,
            "odc": {"accumulator_dtype": "fp64"},
            "steps": 5, "calls": {1: ["lp_params", "lp_grads"], 2: None, 3: ["lp_grads"]}, "non_blocking": True}
    for rank, result in enumerate(run_ranks(offload_round_trip, 2, case, env=rank_env(CASE.name, 2), timeout=300)):
        plain, offloaded = result["plain"], result["offloaded"]
        assert offloaded["losses"] == plain["losses"], f"rank {rank}"
        for step, (a, b) in enumerate(zip(plain["params"], offloaded["params"])):
            assert all(torch.equal(a[k], b[k]) for k in a), f"rank {rank} step {step}"


@pytest.mark.skipif(CASE.device_type != "cuda", reason="device memory is a GPU's")
def test_the_windows_device_memory_is_free_while_they_are_away():
    results = run_ranks(device_memory_while_away, 2, CASE.name, env=rank_env(CASE.name, 2), timeout=300)
    both = sum(r["window_bytes"] for r in results)  # the ranks share one GPU: its free memory counts both
    for rank, result in enumerate(results):
        assert result["away"] - result["before"] >= 0.9 * both, f"rank {rank}: {result}"
        assert result["before"] - result["after"] < 0.1 * both, f"rank {rank}: the windows came back: {result}"
