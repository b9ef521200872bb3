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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple


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

    def __init__(self) -> None:
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
