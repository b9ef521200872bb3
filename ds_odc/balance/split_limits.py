"""Where a job's split micro-batches may run: one object, owned by the engine, read by whoever plans.

An engine with balance policy ``"lb-mini-split"`` creates, at ``deepspeed.initialize``, one process group per
aligned power-of-two block of ranks inside a node, up to the largest group its model's heads allow (or
``balance.max_group``). Those groups are the only ones a split micro-batch can run over, so a plan made with
other limits fails the first time it names a group the engine lacks. The engine therefore owns the limits
(``engine.odc_split_limits``), and :class:`~ds_odc.balance.sampler.BalancedBatchSampler` and the Hugging Face
Trainer read them from it at their first iteration, refusing a mismatch by name there, on every rank.

>>> limits = SplitLimits(world_size=8, node_size=4, max_group=4)
>>> limits.group_sizes, limits.groups(4)
((2, 4), [0, 1])
>>> limits.allows((4, 5, 6, 7)), limits.allows((2, 3, 4, 5)), limits.allows((2, 3))
(True, False, True)
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from ds_odc.arguments import require_whole_number
from ds_odc.balance.split_plan import aligned_groups, group_sizes
from ds_odc.errors import ODCConfigError, ODCError

#: Groups beyond a node's usual 8 ranks are never planned (Ulysses' all-to-alls stay on the node's links).
LARGEST_GROUP = 8


@dataclasses.dataclass(frozen=True)
class SplitLimits:
    """``world_size`` ranks in nodes of ``node_size`` (a group never crosses a node), split micro-batches over
    aligned power-of-two groups of 2 to ``max_group`` ranks (1: none; the model cannot be split)."""

    world_size: int
    node_size: int
    max_group: int

    def __post_init__(self) -> None:
        for name in ("world_size", "node_size", "max_group"):
            require_whole_number(f"SplitLimits: {name}", getattr(self, name), 1)
        if self.max_group & (self.max_group - 1) or self.max_group > LARGEST_GROUP:
            raise ODCError(f"SplitLimits: max_group must be 1, 2, 4 or {LARGEST_GROUP}, got {self.max_group}")
        if self.node_size > self.world_size:
            raise ODCError(f"SplitLimits: node_size {self.node_size} exceeds world_size {self.world_size}")

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """The group sizes a plan may use (those with at least one aligned group inside a node)."""
        return tuple(group_sizes(self.world_size, self.node_size, self.max_group))

    def groups(self, size: int) -> list[int]:
        """Indices ``g`` of the aligned groups of ``size`` (ranks ``g*size ... (g+1)*size - 1``)."""
        return aligned_groups(self.world_size, self.node_size, size) if size in self.group_sizes else []

    def allows(self, ranks: Sequence[int]) -> bool:
        """Whether ``ranks`` (in slice order) are one of the groups, or a single rank (a whole micro-batch)."""
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) == 1:
            return 0 <= ranks[0] < self.world_size
        size = len(ranks)
        return any(ranks == tuple(range(g * size, (g + 1) * size)) for g in self.groups(size))

    def check_matches(self, requested: dict, who: str) -> None:
        """Refuse what ``who`` asked for (field -> value; None: not asked) where it differs from these limits."""
        differing = [f"{name}={value} (the engine's: {getattr(self, name)})" for name, value in requested.items()
                     if value is not None and value != getattr(self, name)]
        if differing:
            raise ODCConfigError(
                f"{who}: {', '.join(differing)}. The engine created its split groups at initialize for "
                f"world_size={self.world_size}, node_size={self.node_size}, max_group={self.max_group} (its "
                "zero_optimization.odc.balance.max_group, or the largest group the model's heads allow): leave these "
                "arguments out to take the engine's, or change the ds_config")

    def describe(self) -> str:
        sizes = ", ".join(map(str, self.group_sizes)) or "none"
        return (f"groups of {sizes} ranks (max_group {self.max_group}) inside nodes of {self.node_size}, "
                f"{self.world_size} ranks")
