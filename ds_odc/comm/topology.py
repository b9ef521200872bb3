"""Which ranks share a host (a node), and the groups a multi-node job is laid out in.

ODC's windows live in memory one host shares (shm) or one node maps (cuda_ipc), so the ranks of a
host form a node. A multi-node layout (``docs/multinode.md``) needs every node to hold the same number
of ranks, numbered node by node as torchrun and the DeepSpeed launcher number them: local rank ``l``
of node ``n`` is global rank ``n * local_world + l``. Its two kinds of groups: a node's ranks, and the
ranks with the same local rank on every node (``cross_group``), which would exchange a step's shards.

>>> topology = Topology.from_hosts(["a", "a", "b", "b"])
>>> topology.describe(), topology.cross_group(1)
('2 nodes x 2 ranks (a: ranks 0-1; b: ranks 2-3)', (1, 3))
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ds_odc.errors import ODCConfigError


@dataclasses.dataclass(frozen=True)
class Topology:
    hosts: tuple[str, ...]
    """the host of each rank, by global rank"""
    nodes: tuple[tuple[int, ...], ...]
    """the ranks of each node, nodes in the order of their lowest rank"""

    @classmethod
    def from_hosts(cls, hosts: Sequence[str]) -> "Topology":
        order: dict[str, list[int]] = {}
        for rank, host in enumerate(hosts):
            order.setdefault(host, []).append(rank)
        return cls(tuple(hosts), tuple(tuple(ranks) for ranks in order.values()))

    @classmethod
    def from_launcher(cls, world_size: int, local_world_size: int) -> "Topology":
        """The layout a launcher announces (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), hosts named node0, node1, ..."""
        if world_size < 1 or local_world_size < 1 or world_size % local_world_size:
            raise ODCConfigError(f"WORLD_SIZE={world_size} is not a whole number of nodes of "
                                 f"LOCAL_WORLD_SIZE={local_world_size} ranks")
        return cls.from_hosts([f"node{rank // local_world_size}" for rank in range(world_size)])

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def local_world_size(self) -> int | None:
        """Ranks per node, or None when nodes differ in size."""
        sizes = {len(ranks) for ranks in self.nodes}
        return sizes.pop() if len(sizes) == 1 else None

    def node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def cross_group(self, local_rank: int) -> tuple[int, ...]:
        """The ranks with this local rank on every node."""
        return tuple(ranks[local_rank] for ranks in self.nodes)

    def check_multi_node_layout(self) -> int:
        """Equal nodes, numbered node by node; otherwise an error naming what is not. Returns the ranks per node."""
        sizes = {self.hosts[ranks[0]]: len(ranks) for ranks in self.nodes}
        local = self.local_world_size
        if local is None:
            raise ODCConfigError(f"nodes hold different numbers of ranks ({sizes}); every node needs the same number")
        for n, ranks in enumerate(self.nodes):
            expected = tuple(range(n * local, (n + 1) * local))
            if ranks != expected:
                raise ODCConfigError(f"ranks {list(ranks)} share host {self.hosts[ranks[0]]!r}; a multi-node layout "
                                     f"needs ranks numbered node by node ({list(expected)} there), as torchrun and "
                                     "the DeepSpeed launcher number them")
        return local

    def describe(self) -> str:
        parts = "; ".join(f"{self.hosts[ranks[0]]}: {_span(ranks)}" for ranks in self.nodes)
        size = self.local_world_size
        shape = f"{self.node_count} node{'s' if self.node_count > 1 else ''} x {size} rank{'s' if size != 1 else ''}" \
            if size is not None else f"{self.node_count} nodes of different sizes"
        return f"{shape} ({parts})"


def _span(ranks: Sequence[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if list(ranks) == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(str(r) for r in ranks)


def launcher_topology(environ: Mapping[str, str]) -> Topology | None:
    """The topology the launcher's environment announces, or None outside a launcher."""
    try:
        world = int(environ["WORLD_SIZE"])
        local = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or world)
    except (KeyError, ValueError):
        return None
    return Topology.from_launcher(world, local)
