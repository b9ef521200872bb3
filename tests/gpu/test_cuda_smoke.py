"""One rank, one step, first: the validation kit runs this before anything else, so that a rank that
did not get the CUDA accelerator, a CUDA context made before the rank started, or an operator that does
not load shows within seconds, not as forty failures later. Skipped without CUDA (on ``shm`` under the
kit's ``--cpu-smoke``, the same plumbing on CPU ranks)."""
import math

from tests.support.cuda_workloads import smoke
from tests.support.harness import run_ranks
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env

CASE = gpu_suite_case()
pytestmark = gpu_suite_skip()


def test_one_rank_trains_one_step_on_its_device_with_its_transport():
    seen = run_ranks(smoke, 1, CASE.name, env=rank_env(CASE.name, 1), timeout=300)[0]
    expected = "cuda" if CASE.device_type == "cuda" else "cpu"
    assert seen["accelerator"] == expected, seen  # DeepSpeed in the rank has the accelerator its env names
    assert seen["engine_device"].startswith(expected) and seen["window_device"].startswith(expected), seen
    assert seen["transport"] == CASE.name, seen
    assert seen["cuda_initialized"] == (expected == "cuda"), seen  # the rank made its own context
    assert len(seen["losses"]) == 2 and all(math.isfinite(loss) for loss in seen["losses"]), seen
