"""Training on GPU through the cuda_ipc transport equals a single process on the same global batch.

ZeRO-3 needs NCCL on GPU, which cannot put several ranks on one GPU, so the references are single
processes: plain PyTorch (fp32) and the ODC engine with one rank on the same GPU (bf16, fp64 sums).
Skipped without CUDA."""
import pytest
import torch

from tests.distributed.compare import worst_rel_diff
from tests.distributed.harness import run_ranks
from tests.distributed.workloads import reference_training
from tests.distributed.transports import gpu_env
from tests.gpu.cuda_workloads import train_schedule

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 5
# GPU and CPU kernels round fp32 differently (cuBLAS vs CPU GEMMs); ODC itself adds only summation order.
GPU_VS_CPU_TOL = 1e-5
SAME_GPU_TOL = 1e-6


def _split(counts):
    return [[(r, i) for i in range(n)] for r, n in enumerate(counts)]


@pytest.mark.parametrize("counts", [(2, 2), (1, 3)], ids=["equal", "uneven-1-3"])
def test_fp32_training_equals_plain_pytorch_single_process(counts):
    results = run_ranks(train_schedule, 2, _split(counts), STEPS, env=gpu_env(2))
    expected = reference_training("managed", counts, steps=STEPS)
    for rank, result in enumerate(results):
        assert result["transport"] == "cuda_ipc" and result["window_device"].startswith("cuda")
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= GPU_VS_CPU_TOL, f"rank {rank}: params differ from the reference by {diff:.2e}"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_two_ranks_equal_one_rank_on_the_same_gpu(bf16):
    """fp64 accumulators make the sums independent of arrival order, so splitting the same four
    micro-batches over two ranks must not change the update."""
    batches = [(r, i) for r in range(2) for i in range(2)]
    two = run_ranks(train_schedule, 2, [batches[:2], batches[2:]], STEPS, bf16, "fp64", env=gpu_env(2))
    one = run_ranks(train_schedule, 1, [batches], STEPS, bf16, "fp64", env=gpu_env(1))[0]
    expected_dtypes = ("torch.bfloat16" if bf16 else "torch.float32", "torch.float64")
    assert two[0]["window_dtypes"] == one["window_dtypes"] == expected_dtypes
    for rank, result in enumerate(two):
        diff = worst_rel_diff(result["params"], one["params"])
        assert diff <= SAME_GPU_TOL, f"rank {rank}: params differ from one rank by {diff:.2e}"
