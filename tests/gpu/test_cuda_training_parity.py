"""Training through the GPU transport equals a single process on the same global batch.

ZeRO-3 needs NCCL on GPU, which cannot put several ranks on one GPU, so the references are single
processes: plain PyTorch (fp32, on the CPU) and the ODC engine with one rank on the same device (fp32 and
bf16, fp64 sums, so that arrival order cannot change a sum). 2 and 4 ranks, equal and uneven
micro-batch counts, mean-over-micro-batches ("managed") and per-token normalisation; and one rank on
NCCL, the one NCCL run one GPU allows. Skipped without CUDA (run on ``shm`` by the kit's ``--cpu-smoke``).
"""
import pytest

from tests.support.compare import worst_rel_diff
from tests.support.cuda_workloads import train_references, train_schedule
from tests.support.harness import run_ranks
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env
from tests.support.workloads import reference_training

CASE = gpu_suite_case()
pytestmark = gpu_suite_skip()

STEPS = 4
# GPU and CPU kernels round fp32 differently (cuBLAS vs CPU GEMMs); ODC itself adds only summation order.
GPU_VS_CPU_TOL = 1e-5
SAME_DEVICE_TOL = 1e-6


def split(counts):
    """Rank r runs counts[r] micro-batches, its own (r, 0..n-1)."""
    return [[(r, i) for i in range(n)] for r, n in enumerate(counts)]


def union(schedule):
    return [batch for mine in schedule for batch in mine]


#: (id, world, counts, bf16, mode): every case runs ``world`` ranks and one rank on the same global batch
CASES = [
    ("2-fp32-equal", 2, (2, 2), False, "managed"),
    ("2-bf16-uneven", 2, (1, 3), True, "managed"),
    ("2-fp32-token-uneven", 2, (1, 3), False, "token"),
    ("4-fp32-equal", 4, (1, 1, 1, 1), False, "managed"),
    ("4-bf16-uneven", 4, (1, 2, 2, 3), True, "managed"),
    ("4-bf16-token-uneven", 4, (3, 1, 2, 2), True, "token"),
]


@pytest.fixture(scope="module")
def one_rank_references(request):
    """The one-rank run of every case this session selected, in one process (engines one after the
    other): one process start instead of one per case."""
    selected = {item.name for item in request.session.items}
    cases = [(case_id, union(split(counts)), bf16, "fp64", mode) for case_id, _, counts, bf16, mode in CASES
             if f"test_ranks_sharing_the_device_equal_one_rank[{case_id}]" in selected]
    return run_ranks(train_references, 1, CASE.name, cases, STEPS, env=rank_env(CASE.name, 1), timeout=400)[0]


@pytest.mark.parametrize("case_id,world,counts,bf16,mode", CASES, ids=[c[0] for c in CASES])
def test_ranks_sharing_the_device_equal_one_rank(case_id, world, counts, bf16, mode, one_rank_references):
    results = run_ranks(train_schedule, world, CASE.name, split(counts), STEPS, bf16, "fp64", mode,
                        env=rank_env(CASE.name, world), timeout=300)
    expected = one_rank_references[case_id]
    dtypes = ("torch.bfloat16" if bf16 else "torch.float32", "torch.float64")
    for rank, result in enumerate(results):
        assert result["transport"] == CASE.name and result["window_device"].startswith(CASE.device_type), result
        assert result["window_dtypes"] == dtypes, result["window_dtypes"]
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= SAME_DEVICE_TOL, f"rank {rank}: params differ from one rank by {diff:.2e}"


@pytest.mark.parametrize("counts", [(1, 3)], ids=["uneven-1-3"])
def test_fp32_training_equals_plain_pytorch_single_process(counts):
    results = run_ranks(train_schedule, 2, CASE.name, split(counts), STEPS, env=rank_env(CASE.name, 2))
    expected = reference_training("managed", counts, steps=STEPS, optimizer="adam", clip=1.0)  # ds_config's default
    for rank, result in enumerate(results):
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= GPU_VS_CPU_TOL, f"rank {rank}: params differ from the reference by {diff:.2e}"


@pytest.mark.skipif(CASE.device_type != "cuda", reason="NCCL needs CUDA ranks")
def test_one_rank_on_nccl_equals_one_rank_on_gloo():
    """NCCL cannot put two ranks on one GPU, so one rank is the NCCL run a single GPU allows: the engine
    starts and trains on an NCCL process group exactly as on gloo."""
    runs = {backend: run_ranks(train_schedule, 1, CASE.name, [union(split((2, 2)))], STEPS, False, "fp64", "managed",
                               env=rank_env(CASE.name, 1), backend=backend)[0] for backend in ("nccl", "gloo")}
    assert runs["nccl"]["backend"] == "nccl" and runs["nccl"]["transport"] == CASE.name, runs["nccl"]
    diff = worst_rel_diff(runs["nccl"]["params"], runs["gloo"]["params"])
    assert diff <= SAME_DEVICE_TOL, f"NCCL differs from gloo by {diff:.2e}"
