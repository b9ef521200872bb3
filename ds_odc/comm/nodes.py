"""The job's nodes: which transport group this rank joins, and its link with the other nodes
(``docs/multinode.md``).

On one host nothing changes: the transport spans the world, and there is nothing to exchange. On
several, the ranks of each host form a node: the transport spans the node (``node_group``), and the
ranks with the same local rank on every node (``cross_group``) meet once per step through
:class:`~ds_odc.comm.cross_node.TorchDistributedLink`. Every rank creates every group, in the same
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

from ds_odc.comm.cross_node import CrossNodeLink, FailureBoard, GlobalLink, TorchDistributedLink
from ds_odc.comm.replica_link import BudgetLink
from ds_odc.comm.topology import Topology
from ds_odc.errors import ODCConfigError, ODCPeerError

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
    #: every rank of the job, for pulls and pushes across nodes (:meth:`open_remote_group`; only where the job's
    #: cross_node mode resolved to one with owners on other nodes)
    remote_group: Any = None
    timeout_s: float = 0.0

    @property
    def node_count(self) -> int:
        return self.topology.node_count

    @property
    def first_rank(self) -> int:
        return self.node * self.local_world

    def open_remote_group(self) -> Any:
        """Collective over every rank (several nodes): a gloo group of the whole job, for the pulls and pushes that
        cross nodes (:mod:`ds_odc.comm.remote`). Made once the job's cross_node mode is resolved, and only where
        it puts owners on other nodes: a replicating job holds no idle group of every rank."""
        if self.remote_group is None:
            timeout = datetime.timedelta(seconds=self.timeout_s + _GROUP_TIMEOUT_MARGIN_S)
            self.remote_group = tdist.new_group(list(range(self.topology.world_size)), timeout=timeout, backend="gloo")
        return self.remote_group

    def link(self, timeout_s: float, heartbeat, mode: str = "replicate") -> CrossNodeLink:
        """This rank's link with the other nodes: nothing to exchange on one node; on several, the
        cross-node group's collectives for the job's ``cross_node`` mode as resolved ("replicate", "global" or
        "budget": not "auto", which resolves to one of them), watched by the job's failure board (its own store
        connection)."""
        if self.node_count == 1:
            return CrossNodeLink()
        kinds = {"replicate": TorchDistributedLink, "global": GlobalLink, "budget": BudgetLink}
        if mode not in kinds:
            raise ValueError(f"no cross-node link for mode {mode!r} (one of {', '.join(kinds)})")
        board = FailureBoard(job_store(timeout_s), self.board_key, timeout_s)
        return kinds[mode](self.cross_group, board, timeout_s, tdist.get_rank(), heartbeat)

    def agree(self, error: Optional[BaseException], doing: str) -> None:
        """Every node's outcome of a step each node agreed on by itself (its windows' allocation): a
        failure on one node raises on every rank of every node, naming that node's error, instead of
        leaving the other nodes to lose the connection later. Collective over the world (several nodes
        only: on one node the node's own agreement was the job's). Raises ``error`` itself on its node."""
        if self.node_count == 1:
            if error is not None:
                raise error
            return
        mine = None if error is None else (f"{type(error).__name__}: {error}", isinstance(error, ODCConfigError))
        outcomes: list = [None] * self.topology.world_size
        tdist.all_gather_object(outcomes, (socket.gethostname(), mine))
        if error is not None:
            raise error
        failed = [(rank, host, outcome) for rank, (host, outcome) in enumerate(outcomes) if outcome is not None]
        if failed:
            rank, host, (text, config_error) = failed[0]
            error_class = ODCConfigError if config_error else ODCPeerError
            raise error_class(f"rank {rank} on {host} failed while {doing}: {text}") from None


def job_nodes(timeout_s: float) -> JobNodes:
    """Collective over every rank: the hosts, the layout check, and the node and cross-node groups (several nodes
    only; the group for pulls across nodes comes later, :meth:`JobNodes.open_remote_group`)."""
    rank = tdist.get_rank()
    mine = (socket.gethostname(), uuid.uuid4().hex[:12])
    everyone: list[Any] = [None] * tdist.get_world_size()  # every rank's (host, id), once gathered
    tdist.all_gather_object(everyone, mine)
    topology = Topology.from_hosts([host for host, _ in everyone])
    if topology.node_count == 1:
        return JobNodes(topology, 0, rank, topology.world_size)
    local_world = topology.check_multi_node_layout()
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
                    board_key=f"ds_odc/{everyone[0][1]}/failure", timeout_s=timeout_s)


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
