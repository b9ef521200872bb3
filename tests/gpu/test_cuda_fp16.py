"""fp16 on the odc stage against ZeRO-3's fp16, one rank on NCCL, with a step whose gradients overflow: the
same steps skipped, the same loss scale after every step, the same parameters. The engine refuses fp16 until
this passes on a GPU (DeepSpeed has no fp16 on CPU); the run lifts the refusal with
``DS_ODC_EXPERIMENTAL_FP16=1`` (ds_odc/config.py). The GPU kit's ``fp16`` item. Skipped without CUDA."""
import pytest

from tests.support.compare import worst_rel_diff
from tests.support.cuda_workloads import fp16_training
from tests.support.harness import run_ranks
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env

CASE = gpu_suite_case()
pytestmark = [gpu_suite_skip(), pytest.mark.skipif(CASE.device_type != "cuda", reason="needs CUDA ranks (NCCL)")]

STEPS, OVERFLOW_STEP = 4, 1
TOL = 1e-5  # one rank, the same device: fp16 gradients land in fp32 exactly on both; only kernels may differ


def test_fp16_with_an_overflow_step_steps_as_zero3_fp16():
    env = {**(rank_env(CASE.name, 1) or {}), "DS_ODC_EXPERIMENTAL_FP16": "1"}
    runs = {stage: run_ranks(fp16_training, 1, CASE.name, stage, STEPS, OVERFLOW_STEP, env=env, backend="nccl",
                             timeout=120)[0] for stage in ("odc", 3)}
    odc, zero3 = runs["odc"], runs[3]
    assert odc["dtype"] == zero3["dtype"] == "torch.float16", runs
    assert odc["optimizer"] != zero3["optimizer"], f"both runs built {odc['optimizer']}: the odc stage did not run"
    skipped = [step["skipped"] for step in zero3["trace"]]
    assert skipped[OVERFLOW_STEP] == skipped[OVERFLOW_STEP - 1] + 1, f"ZeRO-3 did not skip the overflow step: {skipped}"
    assert [s["skipped"] for s in odc["trace"]] == skipped, (odc["trace"], zero3["trace"])
    assert [s["scale"] for s in odc["trace"]] == [s["scale"] for s in zero3["trace"]], (odc["trace"], zero3["trace"])
    for mine, theirs in zip(odc["trace"], zero3["trace"]):
        assert abs(mine["loss"] - theirs["loss"]) <= TOL * max(1.0, abs(theirs["loss"])), (odc["trace"], zero3["trace"])
    diff = worst_rel_diff(odc["params"], zero3["params"])
    assert diff <= TOL, f"ODC fp16 differs from ZeRO-3 fp16 by {diff:.2e} after an overflow step"
