"""Where each parameter's shard sits in the windows: pure layout math, no processes needed.

ZeRO-3 pads a parameter of ``numel`` elements to ``world * shard_numel`` and gives rank ``r`` the
slice ``[r * shard_numel, (r + 1) * shard_numel)`` of the flattened tensor. Every rank holds a
shard of the same size of every parameter, so a parameter's shard sits at the *same offset* in
every owner's window, and one table, computed locally, serves all owners.

Worked example, world 2, parameters A (5 elements, trainable), B (4, trainable), C (3, frozen)::

    shard_numel:  A 3, B 2, C 2
    param window: [A0 A1 A2 | B0 B1 | C0 C1]          offsets A 0, B 3, C 5   (7 elements)
    accumulator:  [A0 A1 A2 | B0 B1]                  offsets A 0, B 3        (5 elements, fp32)
    owner_slices(A): rank 0 holds A[0:3], rank 1 holds A[3:5] (+1 padding element)

On several nodes (``docs/multinode.md``) ZeRO-3 still partitions over every rank of the job, and the
ranks of one node must hold every shard between them, so that pulls and pushes never leave the node.
Local rank ``l`` of each node holds the shards of the ranks with local rank ``l`` on every node (its
cross-node group), one *block* per node: the parameter window is ``node_count`` trainable blocks
(block ``n`` is the flat buffer of rank ``n * local_world + l``) followed by ``node_count`` frozen
blocks, and the accumulator is ``node_count`` trainable blocks. A rank's own shards are its node's
block; with one node there is one block and the layout above is unchanged. The blocks of the
trainable region are contiguous, so the step's reduce-scatter and all-gather over the cross-node
group each run on one tensor::

    world 4 = 2 nodes x 2, parameter A (5 elements, shard_numel 2), trainable_numel 2
    owner_slices(A): ranks 0..2 hold A[0:2], A[2:4], A[4:5]
    local rank 0's window: [A0 A1 | A4 pad]   (rank 0's block, then rank 2's)
    local rank 1's window: [A2 A3 | pad pad]  (rank 1's block, then rank 3's)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Dict, Iterator, Optional, Tuple

from ds_odc.comm.cross_node import NodeBlocks


@dataclass(frozen=True)
class ShardSlot:
    """One parameter's place in the windows."""

    numel: int  # elements of the full, unpartitioned parameter
    shard_numel: int  # elements each owner holds (padded)
    param_offset: int  # offset of the shard in every owner's parameter window
    grad_offset: Optional[int]  # offset in every owner's accumulator; None if frozen


def owner_slices(numel: int, shard_numel: int, world_size: int) -> Iterator[Tuple[int, int, int]]:
    """Yield ``(owner, start, count)``: the real (unpadded) elements of a flat parameter each owner
    holds. Owners whose shard is pure padding are skipped.

    >>> list(owner_slices(5, 3, 2))
    [(0, 0, 3), (1, 3, 2)]
    >>> list(owner_slices(2, 1, 4))
    [(0, 0, 1), (1, 1, 1)]
    """
    for owner in range(world_size):
        start = owner * shard_numel
        count = min(shard_numel, numel - start)
        if count > 0:
            yield owner, start, count


class WindowLayout:
    """Table from a parameter key (DeepSpeed's ``ds_id``) to its :class:`ShardSlot`.

    Trainable shards are laid out first, in the order of the optimizer's flat buffer, so that the
    trainable part of the parameter window *is* that flat buffer; frozen shards follow.
    """

    #: keys whose shards of owners on other nodes this node holds besides its own block (cross_node "budget":
    #: :class:`~ds_odc.runtime.replica_layout.BudgetLayout`); none here
    replicated: AbstractSet[int] = frozenset()

    def __init__(self, node_count: int = 1) -> None:
        self.node_count = node_count
        self.slots: Dict[int, ShardSlot] = {}
        self.trainable_numel = 0
        self.frozen_numel = 0

    def add_trainable(self, key: int, numel: int, shard_numel: int) -> ShardSlot:
        if self.frozen_numel:
            raise ValueError("add every trainable shard before the first frozen one")
        slot = ShardSlot(numel, shard_numel, self.trainable_numel, self.trainable_numel)
        self.slots[key] = slot
        self.trainable_numel += shard_numel
        return slot

    def add_frozen(self, key: int, numel: int, shard_numel: int) -> ShardSlot:
        slot = ShardSlot(numel, shard_numel, self.trainable_numel + self.frozen_numel, None)
        self.slots[key] = slot
        self.frozen_numel += shard_numel
        return slot

    @property
    def param_numel(self) -> int:
        return self.trainable_numel + self.frozen_numel

    @property
    def grad_numel(self) -> int:
        return self.trainable_numel

    # -- node blocks (one per node; see the module docstring) -------------------------------------------
    @property
    def window_numel(self) -> int:
        """Elements of one rank's parameter window: a block per node, trainable blocks first."""
        return self.param_numel * self.node_count

    @property
    def accumulator_numel(self) -> int:
        return self.grad_numel * self.node_count

    @property
    def blocks(self) -> NodeBlocks:
        """Where each node's block sits (what the cross-node link moves)."""
        return NodeBlocks(self.node_count, self.trainable_numel, self.frozen_numel)

    def param_offset(self, slot: ShardSlot, node: int) -> int:
        """Offset of ``slot``'s shard of the rank with this local rank on ``node``, in the window.

        >>> layout = WindowLayout(node_count=2)
        >>> a, c = layout.add_trainable(1, 5, 2), layout.add_frozen(2, 3, 1)
        >>> [layout.param_offset(a, n) for n in (0, 1)], [layout.param_offset(c, n) for n in (0, 1)]
        ([0, 2], [4, 5])
        """
        if slot.grad_offset is not None:
            return self.blocks.trainable(node)[0] + slot.param_offset
        return self.blocks.frozen(node)[0] + slot.param_offset - self.trainable_numel

    def grad_offset(self, slot: ShardSlot, node: int) -> int:
        """Offset of ``slot``'s gradient shard of the rank with this local rank on ``node``, in the accumulator."""
        if slot.grad_offset is None:
            raise ValueError(f"a frozen shard ({slot}) has no gradient in the accumulator")
        return self.blocks.trainable(node)[0] + slot.grad_offset

    def trainable_block(self, node: int) -> tuple[int, int]:
        """``(offset, numel)`` of ``node``'s trainable block in the window and in the accumulator."""
        return self.blocks.trainable(node)

    def frozen_block(self, node: int) -> tuple[int, int]:
        """``(offset, numel)`` of ``node``'s frozen block in the window."""
        return self.blocks.frozen(node)
