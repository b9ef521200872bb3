"""Parameter offload with the model on the GPU: the shards live in host memory (``offload_param: cpu``), so
ODC pulls from and pushes into *host* windows while forward and backward run on the GPU; every step must
equal ZeRO-3's with the same offload. ZeRO-3 on a GPU needs NCCL, which puts one rank on one GPU, so both
run one rank on NCCL (the CPU suite compares 2 ranks: tests/distributed/test_zero3_contracts.py). Skipped
without CUDA."""
import pytest

from tests.support.compare import worst_rel_diff
from tests.support.cuda_workloads import offload_param_training
from tests.support.harness import run_ranks
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env

CASE = gpu_suite_case()
pytestmark = [gpu_suite_skip(), pytest.mark.skipif(CASE.device_type != "cuda", reason="needs CUDA ranks (NCCL)")]

STEPS = 3
TOL = 1e-6  # the same device, the same kernels: only summation order may differ


def test_parameter_offload_with_the_model_on_the_gpu_steps_as_zero3_with_the_same_offload():
    runs = {stage: run_ranks(offload_param_training, 1, CASE.name, stage, 2, STEPS, env=rank_env(CASE.name, 1),
                             backend="nccl", timeout=120)[0] for stage in ("odc", 3)}
    odc, zero3 = runs["odc"], runs[3]
    assert odc["engine_device"].startswith("cuda") and zero3["engine_device"].startswith("cuda"), runs
    assert odc["transport"] == "shm" and odc["window_device"] == "cpu", odc  # host windows, model on the GPU
    diff = worst_rel_diff(odc["params"], zero3["params"])
    assert diff <= TOL, f"ODC with parameter offload differs from ZeRO-3 with the same offload by {diff:.2e}"
