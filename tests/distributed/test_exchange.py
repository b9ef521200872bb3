"""The cross-node step exchange on real gloo groups: 4 ranks of one host as 2 nodes of 2."""
import pytest
import torch

from tests.distributed.exchange_workloads import LOCAL, NODES, one_step
from tests.distributed.harness import run_ranks


@pytest.mark.parametrize("numel", [8, 7, 1])
def test_slices_are_summed_over_nodes_updated_and_gathered_back(numel):
    """A shard that does not divide by the nodes (7, and 1 with an empty slice) must come out exact."""
    results = run_ranks(one_step, NODES * LOCAL, numel, 2, timeout=120)
    total_tokens = float(sum(10 + r for r in range(NODES * LOCAL)))
    for local in range(LOCAL):
        ranks = [r for r in range(NODES * LOCAL) if results[r]["local"] == local]
        # what one process computes: the shard summed over the nodes holding it, SGD on fp32, cast to bf16
        master = torch.zeros(numel)
        for step in range(2):
            summed = sum(torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + r)) for r in ranks)
            master -= 0.1 * summed / total_tokens
        for r in ranks:
            assert torch.equal(results[r]["window"], master.to(torch.bfloat16)), (local, r)
        bounds = sorted(results[r]["bounds"] for r in ranks)
        assert bounds[0][0] == 0 and bounds[-1][1] == numel and bounds[0][1] == bounds[1][0]
    assert all(r["total_tokens"] == total_tokens for r in results)


def test_three_collectives_per_step_whatever_the_size():
    small, large = (run_ranks(one_step, NODES * LOCAL, numel, 3, timeout=120) for numel in (8, 4096))
    assert all(r["collectives_per_step"] == [3, 3, 3] for r in small + large)
