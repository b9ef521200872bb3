"""``cross_node: "budget"``: which parameters form a layer, and where a replicated layer's shards sit.

Layers. A layer is the unit replicated whole or not at all (:func:`~ds_odc.runtime.cross_node_plan.
choose_replicated_layers`): every parameter under ``….layers.<i>.``, ``….h.<i>.``, ``….blocks.<i>.`` (and the
singular ``layer``/``block``) is one layer, named by that prefix (the outermost such prefix: an expert list
inside a layer stays in it); any other parameter is a unit of its own. Layers come in the order of their first
parameter's key, DeepSpeed's ``ds_id``, which ZeRO-3 assigns in module registration order, the forward order
of most models and the same on every rank.

Layout. The window is global sharding's own block followed by a replica region (the block math is
:class:`~ds_odc.comm.replica_link.ReplicaBlocks`); this module adds the table of each replicated parameter's
place in a replica slot. World 4 = 2 nodes x 2 ranks, trainable A (5 elements, shard 2) and B (3, shard 1),
frozen C (4, shard 1), with A and C replicated::

    own block:    [A0 A1 | B0 | C0]                  A at 0, B at 2, C at 3   (global sharding's)
    replica slot: [A of the other node's rank | C of it]   at 4: A at 4, C at 6
    window 7 elements, accumulator [A0 A1 | B0 | A of the other node's rank] 5 elements

>>> layout = BudgetLayout(nodes=2)
>>> a, b, c = layout.add_trainable(1, 5, 2), layout.add_trainable(2, 3, 1), layout.add_frozen(3, 4, 1)
>>> layout.replicate({1, 3})
>>> layout.window_numel, layout.accumulator_numel
(7, 5)
>>> layout.replica_param_offset(1, 0), layout.replica_param_offset(3, 0), layout.replica_grad_offset(1, 0)
(4, 6, 3)
"""
from __future__ import annotations

import re
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

from ds_odc.comm.replica_link import ReplicaBlocks, Runs
from ds_odc.runtime.cross_node_plan import Layer
from ds_odc.runtime.layout import ShardSlot, WindowLayout

#: The outermost ``<prefix>.layers.<i>`` (or ``h``, ``blocks``, ``layer``, ``block``) of a parameter's name.
LAYER_PREFIX = re.compile(r"^((?:.*?\.)?(?:layers|layer|h|blocks|block)\.\d+)\.")


def layer_name(param_name: str) -> str:
    """The layer a parameter belongs to (see the module docstring).

    >>> layer_name("model.layers.3.mlp.experts.layers.1.weight"), layer_name("transformer.h.11.attn.bias")
    ('model.layers.3', 'transformer.h.11')
    >>> layer_name("lm_head.weight"), layer_name("blocks.0.weight")
    ('lm_head.weight', 'blocks.0')
    """
    match = LAYER_PREFIX.match(param_name)
    return match.group(1) if match else param_name


def group_layers(params: Sequence[Tuple[int, str, int, bool]]) -> Tuple[List[Layer], Dict[str, Tuple[int, ...]]]:
    """``params`` as ``(key, name, numel, trainable)``: the layers in key order as the planner takes them
    (``(name, trainable numel, frozen numel)``) and each layer's keys. A parameter without a name is a unit of
    its own, named by its key.

    >>> group_layers([(2, "h.0.b", 3, True), (1, "h.0.w", 6, True), (3, "h.0.f", 2, False), (4, "", 5, True)])
    ([('h.0', 9, 2), ('param 4', 5, 0)], {'h.0': (1, 2, 3), 'param 4': (4,)})
    """
    sizes: Dict[str, List[int]] = {}
    members: Dict[str, List[int]] = {}
    for key, name, numel, trainable in sorted(params):
        layer = layer_name(name) if name else f"param {key}"
        sizes.setdefault(layer, [0, 0])[0 if trainable else 1] += numel
        members.setdefault(layer, []).append(key)
    return ([(layer, trainable, frozen) for layer, (trainable, frozen) in sizes.items()],
            {layer: tuple(keys) for layer, keys in members.items()})


class BudgetLayout(WindowLayout):
    """Global sharding's table (one own block) plus the replica region of ``nodes - 1`` slots. Add every shard
    as in :class:`WindowLayout`, then call :meth:`replicate` once with the replicated keys."""

    def __init__(self, nodes: int) -> None:
        super().__init__(node_count=1)
        self.nodes = nodes
        self.replicated: AbstractSet[int] = frozenset()
        self._packed: Dict[int, int] = {}  # key -> offset inside a replica slot (window; trainable: accumulator too)
        self._trainable_runs: Runs = ()
        self._frozen_runs: Runs = ()
        self._replica = (0, 0)  # trainable, frozen elements of one replica slot
        self._blocks: Optional[ReplicaBlocks] = None  # fixed by replicate (offsets are asked on every pull)

    def replicate(self, keys: AbstractSet[int]) -> None:
        """Keep ``keys`` (trainable and frozen) node-local: pack them, trainable then frozen, each in window order."""
        unknown = set(keys) - set(self.slots)
        if unknown:
            raise ValueError(f"replicated keys {sorted(unknown)} are not in the layout")
        self.replicated = frozenset(keys)
        chosen = sorted((self.slots[key].param_offset, key) for key in self.replicated)
        trainable = [(offset, key) for offset, key in chosen if self.slots[key].grad_offset is not None]
        frozen = [(offset, key) for offset, key in chosen if self.slots[key].grad_offset is None]
        position = 0
        for _, key in trainable + frozen:
            self._packed[key] = position
            position += self.slots[key].shard_numel
        self._trainable_runs = _runs([(offset, self.slots[key].shard_numel) for offset, key in trainable])
        self._frozen_runs = _runs([(offset, self.slots[key].shard_numel) for offset, key in frozen])
        replica_trainable = sum(self.slots[key].shard_numel for _, key in trainable)
        self._replica = (replica_trainable, position - replica_trainable)
        self._blocks = None
        self._blocks = self.blocks

    @property
    def blocks(self) -> ReplicaBlocks:
        if self._blocks is not None:
            return self._blocks
        return ReplicaBlocks(1, self.trainable_numel, self.frozen_numel, nodes=self.nodes,
                             trainable_runs=self._trainable_runs, frozen_runs=self._frozen_runs,
                             replica_trainable=self._replica[0], replica_frozen=self._replica[1])

    @property
    def window_numel(self) -> int:
        return self.blocks.window_numel

    @property
    def accumulator_numel(self) -> int:
        return self.blocks.accumulator_numel

    def replica_param_offset(self, key: int, index: int) -> int:
        """Offset, in the window, of replicated ``key``'s shard in replica slot ``index``."""
        return self.blocks.window_slot(index)[0] + self._packed[key]

    def replica_grad_offset(self, key: int, index: int) -> int:
        """Offset, in the accumulator, of replicated trainable ``key``'s gradient shard in replica slot ``index``."""
        slot: ShardSlot = self.slots[key]
        if slot.grad_offset is None:
            raise ValueError(f"a frozen shard ({slot}) has no gradient in the accumulator")
        return self.blocks.accumulator_slot(index)[0] + self._packed[key]


def _runs(pieces: List[Tuple[int, int]]) -> Runs:
    """``(offset, numel)`` pieces in order, adjacent ones merged.

    >>> _runs([(0, 2), (2, 3), (7, 1)])
    ((0, 5), (7, 1))
    """
    merged: List[Tuple[int, int]] = []
    for offset, numel in pieces:
        if merged and merged[-1][0] + merged[-1][1] == offset:
            merged[-1] = (merged[-1][0], merged[-1][1] + numel)
        else:
            merged.append((offset, numel))
    return tuple(merged)
