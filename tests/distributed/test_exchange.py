"""The cross-node step exchange on real gloo groups and a real store: 4 ranks of one host as 2 nodes of 2."""
import torch

from tests.support.exchange_workloads import LOCAL, NODES, _values, failure_reaches_the_other_node, one_step
from tests.support.harness import run_ranks

WORLD = NODES * LOCAL


def test_gradients_summed_over_nodes_into_each_owner_block_and_windows_gathered():
    results = run_ranks(one_step, WORLD, timeout=120)
    for result in results:
        node, local = result["node"], result["local"]
        cross = [r for r in range(WORLD) if r % LOCAL == local]
        block = result["accumulator"].numel() // NODES
        for salt, key in ((None, "after_first"), (1, "accumulator")):
            # this rank's block: the sum over its cross group of that block; the other blocks: zero
            expected = torch.zeros_like(result["accumulator"])
            mine = slice(node * block, (node + 1) * block)
            expected[mine] = sum(_values(r, NODES * block, 0)[mine] for r in cross)
            if salt is not None:
                expected[mine] += sum(_values(r, NODES * block, salt)[mine] for r in cross)
            torch.testing.assert_close(result[key], expected, rtol=1e-12, atol=1e-12)
        # every block of the window is the cross-group rank's own, bytes as written; frozen blocks too
        window = result["window"].float()
        trainable = window[:NODES * block].view(NODES, block)
        frozen = window[NODES * block:].view(NODES, -1)
        for n in range(NODES):
            owner = n * LOCAL + local
            assert torch.all(trainable[n] == torch.tensor(owner + 0.5, dtype=torch.bfloat16).float())
            assert torch.all(frozen[n] == torch.tensor(-(owner + 0.5), dtype=torch.bfloat16).float())
        # each node's rows stacked in node order (each rank passed LOCAL rows of its own rank id)
        assert result["rows"][:, 0].tolist() == [float(n * LOCAL + local) for n in range(NODES) for _ in range(LOCAL)]
        assert result["norm"] == sum(n + 1.0 for n in range(NODES))
        # a step's: the rows, the reduce, the sum and the trainable gather, plus the frozen gather here
        assert result["step_collectives"] == 5


def test_a_failure_posted_on_one_node_stops_the_others_waiting_in_the_exchange():
    # the board, not the timeout
    results = run_ranks(failure_reaches_the_other_node, WORLD, "posted", 30.0, timeout=120)
    waiting = [r for r in results if r["rank"] == 1]  # rank 1 shares rank 3's cross-node group
    for result in waiting:
        assert result["error"] == "ODCPeerError", result
        assert result["message"].startswith("rank 3 failed at the step fence (step 7): RuntimeError: injected"), result
        assert result["origin"] == 3 and result["waited_s"] < 10, result


def test_a_silent_node_is_bounded_by_the_timeout():
    results = run_ranks(failure_reaches_the_other_node, WORLD, "silent", 3.0, timeout=120)
    result = results[1]
    assert result["error"] == "ODCTimeoutError", result
    assert "waited 3s for the other nodes" in result["message"], result
    assert 3.0 <= result["waited_s"] < 8.0, result
    assert result["heartbeats"] > 0  # its node's peers saw it alive while it waited


def test_a_stalled_rank_found_by_its_node_just_after_the_timeout_is_named():
    """Rank 3 stalls inside the step (the ``budget_stalled_sum`` case of test_two_hosts_global.py): its node peer
    finds it by the node's rounds after timeout_s, about when rank 1's wait for it in the cross-node collective
    runs out. Rank 1 must name rank 3 from the board, not only say that it waited for "the other nodes"."""
    results = run_ranks(failure_reaches_the_other_node, WORLD, "stalled", 3.0, timeout=120)
    result = results[1]
    assert result["error"] == "ODCPeerError", result
    assert result["message"].startswith("rank 3 made no progress for 3s"), result
    assert result["origin"] == 3 and 3.0 <= result["waited_s"] < 6.0, result
