"""The cross-node link of ``cross_node: "budget"``: global sharding, except whole layers replicated per node.

Each rank's windows start as global sharding's (its own block: its trainable shards in ZeRO-3's flat-buffer
order, then its frozen ones), followed by a *replica region*: for every other node, in node order, the shards
that the rank with this local rank on that node owns of the replicated parameters, packed (trainable, then
frozen). The accumulator likewise: the own trainable block, then one packed trainable slot per other node.
(:class:`ReplicaBlocks`; the table of which parameter sits where is :mod:`ds_odc.runtime.replica_layout`.)

Pulls and pushes of a replicated parameter stay in the node (its shard of an owner on another node is read
from, or added into, the replica slot of the node's rank with the owner's local rank); the others reach their
owners on other nodes one-sided (:mod:`ds_odc.comm.remote`), as with global sharding. So at the step, over the
cross-node group (one rank per node, same local rank), :class:`BudgetLink` runs on the replicated part only what
:class:`~ds_odc.comm.cross_node.TorchDistributedLink` runs on everything:

1. ``reduce_gradients``: a reduce-scatter (list form: one tensor per node), where node ``n``'s input is this
   rank's packed own replicated gradients if ``n`` is this node, else its replica slot for ``n``; the packed sum
   goes back into the own block's replicated places, the replica region is zeroed;
2. ``gather_windows``: an all-gather of the own replicated shards, packed, into the other ranks' replica slots
   (trainable after an update; frozen too when windows were opened or rewritten).

[Note: a collective after a node round is a job barrier] A member of the cross-node group enters a collective
only after its node's round (the fence, or the publish that follows the gather), and a node's round completes
only when every rank of that node has arrived. So once this rank's collective has completed, every member has
entered it, hence every rank of every node has passed the round before it: the reduce-scatter after the fence
also says every push (acknowledged, :mod:`ds_odc.comm.remote`) has landed, and the gather before the publish
round says every owner has updated by the time that round completes. That is all :class:`GlobalLink`'s barriers
give, so where there is something to move the collective stands in for the barrier; where there is nothing
(no replicated trainable shard), the barrier stays.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as tdist

from ds_odc.comm.cross_node import GlobalLink, NodeBlocks

Runs = Tuple[Tuple[int, int], ...]
"""``(offset, numel)`` pieces of a window or accumulator, in packing order."""


@dataclass(frozen=True)
class ReplicaBlocks(NodeBlocks):
    """Where the replicated part sits in one rank's windows (``node_count`` is 1: one own block, as global).

    ``nodes``: the job's nodes; ``trainable_runs`` / ``frozen_runs``: where the own replicated trainable (window and
    accumulator: the same offsets) and frozen (window) shards sit, in packing order; ``replica_trainable`` /
    ``replica_frozen``: their element counts, the size of one replica slot's two parts.

    World 4 = 2 nodes x 2, own block of 5 trainable and 2 frozen elements, trainable elements 0-1 and 4 and frozen
    element 6 replicated:

    >>> blocks = ReplicaBlocks(1, 5, 2, nodes=2, trainable_runs=((0, 2), (4, 1)), frozen_runs=((6, 1),),
    ...                        replica_trainable=3, replica_frozen=1)
    >>> blocks.window_slot(0), blocks.accumulator_slot(0), blocks.slot_of(node=0, this_node=1)
    ((7, 4), (5, 3), 0)
    >>> blocks.window_numel, blocks.accumulator_numel
    (11, 8)
    """

    nodes: int = 1
    trainable_runs: Runs = ()
    frozen_runs: Runs = ()
    replica_trainable: int = 0
    replica_frozen: int = 0

    @property
    def window_numel(self) -> int:
        return self.trainable_numel + self.frozen_numel + (self.nodes - 1) * (self.replica_trainable
                                                                                + self.replica_frozen)

    @property
    def accumulator_numel(self) -> int:
        return self.trainable_numel + (self.nodes - 1) * self.replica_trainable

    @staticmethod
    def slot_of(node: int, this_node: int) -> int:
        """Index of ``node``'s replica slot in the windows of a rank on ``this_node`` (the other nodes in order)."""
        if node == this_node:
            raise ValueError(f"node {node} is this rank's own: its shards are in the own block, not a replica slot")
        return node if node < this_node else node - 1

    def window_slot(self, index: int) -> tuple[int, int]:
        """``(offset, numel)`` of replica slot ``index`` in the window: trainable part, then frozen part."""
        width = self.replica_trainable + self.replica_frozen
        return self.trainable_numel + self.frozen_numel + index * width, width

    def accumulator_slot(self, index: int) -> tuple[int, int]:
        """``(offset, numel)`` of replica slot ``index`` in the accumulator (one per region, see exact sums)."""
        return self.trainable_numel + index * self.replica_trainable, self.replica_trainable


def pack(tensor: torch.Tensor, runs: Runs) -> torch.Tensor:
    """The pieces ``runs`` of ``tensor``, copied into one contiguous tensor in order."""
    if not runs:
        return tensor.new_empty(0)
    return torch.cat([tensor.narrow(0, offset, numel) for offset, numel in runs])


def unpack(packed: torch.Tensor, tensor: torch.Tensor, runs: Runs) -> None:
    """Undo :func:`pack`: each piece of ``packed`` back into its place in ``tensor``."""
    start = 0
    for offset, numel in runs:
        tensor.narrow(0, offset, numel).copy_(packed.narrow(0, start, numel))
        start += numel


class BudgetLink(GlobalLink):
    """The link of ``cross_node: "budget"`` (see the module docstring): global sharding's barriers, with the
    replicated layers summed and gathered over the cross-node group as replicate does for every layer."""

    def reduce_gradients(self, accumulator: torch.Tensor, blocks: NodeBlocks) -> None:
        """The replicated part: every node's pushes summed into its owner's own block, the replica region zeroed;
        the rest landed in place already. ``accumulator`` is one region (exact sums call this once per region)."""
        assert isinstance(blocks, ReplicaBlocks)
        if blocks.replica_trainable == 0:
            super().reduce_gradients(accumulator, blocks)
            return
        mine = pack(accumulator, blocks.trainable_runs)
        inputs = [mine if node == self.node else accumulator.narrow(0, *blocks.accumulator_slot(
            blocks.slot_of(node, self.node))) for node in range(self.node_count)]
        total = torch.empty_like(mine)
        self._run(lambda: tdist.reduce_scatter(total, inputs, group=self.cross_group, async_op=True),
                  "summing the replicated layers' gradients over nodes")  # and a barrier: see the Note
        unpack(total, accumulator, blocks.trainable_runs)
        accumulator.narrow(0, blocks.trainable_numel, (blocks.nodes - 1) * blocks.replica_trainable).zero_()

    def gather_windows(self, window: torch.Tensor, blocks: NodeBlocks, frozen: bool = False) -> None:
        """Every owner's replicated shards (trainable; with ``frozen``, frozen too) into every other node's replica
        slots, bytes as they are; then remote pulls may begin (the Note in the module docstring)."""
        assert isinstance(blocks, ReplicaBlocks)
        runs = blocks.trainable_runs + (blocks.frozen_runs if frozen else ())
        width = blocks.replica_trainable + (blocks.replica_frozen if frozen else 0)
        if width == 0:
            super().gather_windows(window, blocks, frozen)
            return
        mine = pack(window, runs).view(torch.uint8)
        outputs = [torch.empty_like(mine) if node == self.node else window.narrow(
            0, blocks.window_slot(blocks.slot_of(node, self.node))[0], width).view(torch.uint8)
            for node in range(self.node_count)]
        self._run(lambda: tdist.all_gather(outputs, mine, group=self.cross_group, async_op=True),
                  "gathering the replicated layers' updated shards from every node")
