"""The job's nodes as the engine uses them: which transport group this rank joins, and its exchange
with the other nodes (``docs/multinode.md``).

On one host nothing changes: the transport spans the world, and there is nothing to exchange. On
several, the ranks of each host form a node: the transport spans the node (``node_group``), and the
ranks with the same local rank on every node (``cross_group``) meet once per step through
:class:`~ds_odc.runtime.exchange.CrossNodeExchange`. Every rank creates every group, in the same
order, as ``torch.distributed.new_group`` requires.
"""
from __future__ import annotations

import datetime
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as tdist

from ds_odc.errors import ODCConfigError
from ds_odc.runtime.topology import Topology

#: Cross-node collectives wait ``timeout_s`` by ODC's own clock; gloo's must not fire first.
_GROUP_TIMEOUT_MARGIN_S = 60.0


@dataclass
class JobNodes:
    """This rank's place in the job's nodes."""

    topology: Topology
    node: int
    local_rank: int
    local_world: int
    node_group: Any = None  # None: the default group (one node)
    cross_group: Any = None  # None on one node
    board_key: str = ""

    @property
    def node_count(self) -> int:
        return self.topology.node_count

    @property
    def first_rank(self) -> int:
        return self.node * self.local_world


def job_nodes(timeout_s: float) -> JobNodes:
    """Collective over every rank: the hosts, the layout check, and the groups (several nodes only)."""
    rank = tdist.get_rank()
    mine = (socket.gethostname(), uuid.uuid4().hex[:12])
    everyone: list[Optional[tuple]] = [None] * tdist.get_world_size()
    tdist.all_gather_object(everyone, mine)
    topology = Topology.from_hosts([host for host, _ in everyone])
    if topology.node_count == 1:
        return JobNodes(topology, 0, rank, topology.world_size)
    topology.check_multi_node_layout()
    local_world = topology.local_world_size
    node, local_rank = divmod(rank, local_world)
    timeout = datetime.timedelta(seconds=timeout_s + _GROUP_TIMEOUT_MARGIN_S)
    node_group = cross_group = None
    for ranks in topology.nodes:
        group = tdist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            node_group = group
    for local in range(local_world):
        ranks = topology.cross_group(local)
        group = tdist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            cross_group = group
    return JobNodes(topology, node, local_rank, local_world, node_group, cross_group,
                    board_key=f"ds_odc/{everyone[0][1]}/failure")


def job_store(timeout_s: float):
    """A connection of this rank's own to the job's key-value store: the ``torch.distributed``
    rendezvous store at ``MASTER_ADDR:MASTER_PORT``, which every node reaches (torchrun's agent store,
    or rank 0's under the DeepSpeed launcher).

    Its own connection, not the process group's: gloo uses that one from its worker threads while a
    collective is in flight, and two threads on one store client break its connection."""
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ODCConfigError("the odc stage across nodes needs MASTER_ADDR and MASTER_PORT (set by torchrun and the "
                             "DeepSpeed launcher): its ranks on every node reach the job's store there") from None
    return tdist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
