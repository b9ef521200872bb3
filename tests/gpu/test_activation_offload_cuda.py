"""Activation offload on a GPU: copy and prefetch streams, a pinned pool; the numbers do not change and the
long micro-batch's peak memory falls. Skipped without CUDA (not run yet: no GPU where it was written)."""
import pytest
import torch

from tests.support.activation_workloads import cuda_offload_variants
from tests.support.harness import run_ranks
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env

CASE = gpu_suite_case()
pytestmark = [gpu_suite_skip(), pytest.mark.skipif(CASE.device_type != "cuda", reason="needs a CUDA device")]


def test_offload_on_a_gpu_changes_no_number_and_cuts_the_long_micro_batch_s_peak():
    off, every = run_ranks(cuda_offload_variants, 1, [None, {"budget_mb": 0}], env=rank_env(CASE.name, 1),
                           timeout=300)[0]
    assert off["losses"] == every["losses"]
    assert all(torch.equal(every["params"][name], tensor) for name, tensor in off["params"].items())
    assert every["pinned"] and all(s["moved_bytes"] == s["planned_bytes"] == s["returned_bytes"] > 0
                                   for s in every["history"])
    long_off, long_on = off["peaks"][1::2], every["peaks"][1::2]  # the 4096-row micro-batches
    assert max(on / before for on, before in zip(long_on, long_off)) < 0.75, (long_on, long_off)
