"""Nodes from the hosts ranks report, and the layout a multi-node job needs."""
import pytest

from ds_odc.comm.topology import Topology, launcher_topology
from ds_odc.errors import ODCConfigError


def test_ranks_group_by_host_with_local_ranks_and_cross_groups():
    topology = Topology.from_hosts(["h0", "h0", "h0", "h1", "h1", "h1"])
    assert topology.node_count == 2 and topology.local_world_size == 3 and topology.world_size == 6
    assert [topology.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [topology.local_rank(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [topology.cross_group(local) for local in range(3)] == [(0, 3), (1, 4), (2, 5)]
    topology.check_multi_node_layout()
    assert topology.describe() == "2 nodes x 3 ranks (h0: ranks 0-2; h1: ranks 3-5)"
    assert Topology.from_hosts(["solo"]).describe() == "1 node x 1 rank (solo: rank 0)"


def test_unequal_or_interleaved_nodes_are_refused_by_name():
    with pytest.raises(ODCConfigError, match=r"different numbers of ranks \({'a': 2, 'b': 1}\)"):
        Topology.from_hosts(["a", "a", "b"]).check_multi_node_layout()
    with pytest.raises(ODCConfigError, match=r"ranks \[0, 2\] share host 'a'.*\[0, 1\] there"):
        Topology.from_hosts(["a", "b", "a", "b"]).check_multi_node_layout()
    assert Topology.from_hosts(["a", "b", "a", "b"]).describe() == \
        "2 nodes x 2 ranks (a: ranks 0, 2; b: ranks 1, 3)"


def test_the_launchers_environment_gives_the_layout():
    assert launcher_topology({}) is None
    topology = launcher_topology({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert topology.node_count == 2 and topology.cross_group(3) == (3, 7)
    assert launcher_topology({"WORLD_SIZE": "2"}).node_count == 1
    with pytest.raises(ODCConfigError, match="WORLD_SIZE=6 is not a whole number of nodes of LOCAL_WORLD_SIZE=4"):
        launcher_topology({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
