"""What a step's split plan is (the policy that makes one: :mod:`ds_odc.balance.split`): aligned groups,
split micro-batches in one order, each rank's list, and what the plan costs.

Groups are aligned powers of two inside a node: group ``g`` of size ``p`` is ranks ``[g·p, (g+1)·p)``,
and never crosses a node boundary (ranks ``[k·n, (k+1)·n)`` share node ``k`` for a node size ``n``):

>>> aligned_groups(16, 8, 4), SplitMicroBatch((5,), 4, 3).ranks
([0, 1, 2, 3], (12, 13, 14, 15))

A rank's list runs its split micro-batches first, in the plan's one order, then its whole ones:

>>> from ds_odc.balance.split_cost import AllToAllCost, SplitCostModel
>>> from ds_odc.balance.cost import CostModel
>>> plan = SplitPlan((8, 3, 3, 2), token_cap=8, cost=SplitCostModel(CostModel.tokens(), AllToAllCost.free()),
...                  node_size=2, splits=(SplitMicroBatch((0,), 2, 0),), whole=(((1, 3),), ((2,),)))
>>> [(mb.samples, mb.ranks, mb.sequence, mb.part(1)) for mb in plan.for_rank(1)]
[((0,), (0, 1), 0, 1), ((2,), (1,), -1, 0)]
>>> plan.rank_finish(), plan.step_cost(), round(plan.idle_fraction(), 4)  # rank 0: 4 + 3 + 2, rank 1: 4 + 3
([9.0, 7.0], 9.0, 0.1111)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from ds_odc.balance.packing import check_samples
from ds_odc.balance.split_cost import SplitCostModel
from ds_odc.errors import ODCError

SPLIT_POLICY = "lb-mini-split"


def aligned_groups(world_size: int, node_size: int, group_size: int) -> list[int]:
    """Indices ``g`` of the groups ``[g·p, (g+1)·p)`` of ``group_size`` ranks inside the world and one node.

    >>> aligned_groups(16, 8, 4), aligned_groups(12, 8, 8), aligned_groups(4, 8, 8)
    ([0, 1, 2, 3], [0], [])
    """
    if group_size < 1 or node_size < 1:
        raise ODCError(f"group and node sizes must be >= 1, got {group_size} and {node_size}")
    return [g for g in range(world_size // group_size)
            if (g * group_size) // node_size == ((g + 1) * group_size - 1) // node_size]


def group_sizes(world_size: int, node_size: int, max_group: int) -> list[int]:
    """The powers of two from 2 to ``max_group`` that have at least one aligned group.

    >>> group_sizes(32, 8, 8), group_sizes(4, 8, 8), group_sizes(1, 8, 8), group_sizes(16, 8, 2)
    ([2, 4, 8], [2, 4], [], [2])
    """
    sizes, p = [], 2
    while p <= max_group:
        if aligned_groups(world_size, node_size, p):
            sizes.append(p)
        p *= 2
    return sizes


def smallest_group(length: int, token_cap: int, sizes: Sequence[int]) -> int | None:
    """The fewest ranks a sample of ``length`` tokens can run on under ``token_cap`` tokens a rank: 1 (whole) up
    to the cap, else the smallest of the group ``sizes`` that holds it, else None.

    [Note: a member's share] A split micro-batch of ``t`` tokens over ``p`` ranks gives each member
    ``ceil(t / p)`` tokens (:func:`~ds_odc.balance.slices.split_batch` pads the sequence to a multiple of
    ``p``), so it fits the cap exactly when ``t <= p × token_cap``: 2001 tokens under a cap of 1000 pad to
    2002 over 2 ranks, 1001 each, and need 4.

    >>> [smallest_group(n, 1000, [2, 4]) for n in (1000, 1001, 2000, 2001, 4000, 4001)]
    [1, 2, 2, 4, 4, None]
    """
    for p in (1, *sorted(sizes)):
        if length <= p * token_cap:
            return p
    return None


def smallest_groups(lengths: Sequence[int], token_cap: int, world_size: int, node_size: int,
                    max_group: int) -> dict[int, int]:
    """Each sample longer than ``token_cap`` (by index) and the smallest group that brings its members under
    the cap (:func:`smallest_group`; the groups: :func:`group_sizes`). A split plan must split these, whatever
    it prefers otherwise: the cap is what a rank's activation memory holds. A sample that not even the largest
    group holds is refused, naming it and what to change.

    >>> smallest_groups([500, 3000, 900], 1000, world_size=8, node_size=8, max_group=4)
    {1: 4}
    >>> smallest_groups([500, 3000], 1000, world_size=8, node_size=8, max_group=2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ds_odc.errors.ODCError: sample 1 has 3000 tokens, more than token_cap=1000 × 2 ranks = 2000 tokens, ...
    """
    check_samples(lengths, token_cap)
    sizes = group_sizes(world_size, node_size, max_group)
    largest = max(sizes, default=1)
    forced = {}
    for index, length in enumerate(lengths):
        group = smallest_group(length, token_cap, sizes)
        if group is None:
            raise ODCError(_too_long(index, length, token_cap, largest, world_size, node_size, max_group))
        if group > 1:
            forced[index] = group
    return forced


def _too_long(index, length, token_cap, largest, world_size, node_size, max_group) -> str:
    limits = f"max_group {max_group}, node size {node_size}, world size {world_size}"
    if largest == 1:
        return (f"sample {index} has {length} tokens, more than token_cap={token_cap}, and no sample can be split "
                f"here (no aligned group of 2 or more ranks: {limits}): raise token_cap, or truncate the sample")
    return (f"sample {index} has {length} tokens, more than token_cap={token_cap} × {largest} ranks = "
            f"{largest * token_cap} tokens, the most the largest group holds ({limits}; a member holds "
            "ceil(tokens / ranks)): raise token_cap or max_group (the model's heads must divide by a larger "
            "group), or truncate the sample")


def max_group_for_heads(attention_heads: int, kv_heads: int, limit: int = 8) -> int:
    """The largest power-of-two group (at most ``limit``) Ulysses can split a model over: the query heads
    must divide by it, and the key/value heads must divide by it or divide it (ALST then replicates them).
    1 means the model cannot be split.

    >>> max_group_for_heads(12, 2), max_group_for_heads(28, 4), max_group_for_heads(40, 8), max_group_for_heads(7, 7)
    (4, 4, 8, 1)
    """
    if attention_heads < 1 or kv_heads < 1 or attention_heads % kv_heads:
        raise ODCError(f"head counts {attention_heads} (query) and {kv_heads} (key/value) are not a valid "
                       "grouped-query attention")
    best, p = 1, 2
    while p <= limit:
        if attention_heads % p == 0 and (kv_heads % p == 0 or p % kv_heads == 0):
            best = p
        p *= 2
    return best


@dataclasses.dataclass(frozen=True)
class SplitMicroBatch:
    """The packed ``samples`` run as one micro-batch over the ranks of aligned group ``group_index`` of
    ``group_size`` (each member holds ``1/p`` of the packed tokens)."""

    samples: tuple[int, ...]
    group_size: int
    group_index: int

    @property
    def ranks(self) -> tuple[int, ...]:
        first = self.group_index * self.group_size
        return tuple(range(first, first + self.group_size))


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One entry of a rank's list for a step: the ``samples`` it runs (indices into the minibatch) and
    the ``ranks`` that run it together (the group, in slice order, for a split one; the rank alone for a
    whole one). ``sequence`` is a split micro-batch's place in the plan's order (what a lockstep check
    compares); -1 for a whole one."""

    samples: tuple[int, ...]
    ranks: tuple[int, ...]
    sequence: int = -1

    @property
    def split(self) -> bool:
        return len(self.ranks) > 1

    def part(self, rank: int) -> int:
        """Which slice ``rank`` takes: its place in the group (slice ``k`` of ``p`` holds tokens
        ``[k·t/p, (k+1)·t/p)`` of the micro-batch's ``t`` packed tokens, as ALST slices)."""
        return self.ranks.index(rank)


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """``splits`` in the order every member runs them, then ``whole[rank][m]`` (sample indices of the
    rank's m-th whole micro-batch, heaviest first). Priced by ``cost``; tokens per member under ``token_cap``
    (so a sample longer than the cap is split: :func:`smallest_groups`)."""

    lengths: tuple[int, ...]
    token_cap: int
    cost: SplitCostModel
    node_size: int
    splits: tuple[SplitMicroBatch, ...]
    whole: tuple[tuple[tuple[int, ...], ...], ...]
    policy: str = SPLIT_POLICY

    @property
    def world_size(self) -> int:
        return len(self.whole)

    def for_rank(self, rank: int) -> list[MicroBatch]:
        """What ``rank`` runs this step, in order: its split micro-batches, then its whole ones."""
        if not 0 <= rank < self.world_size:
            raise ODCError(f"rank {rank} is outside a world of {self.world_size}")
        mine = [MicroBatch(s.samples, s.ranks, k) for k, s in enumerate(self.splits) if rank in s.ranks]
        return mine + [MicroBatch(tuple(batch), (rank,)) for batch in self.whole[rank]]

    def member_cost(self, split: SplitMicroBatch) -> float:
        return self.cost.member_batch([self.lengths[i] for i in split.samples], split.group_size)

    def split_schedule(self) -> list[tuple[float, float]]:
        """(start, end) of every split micro-batch under the cost model: it starts when its last member
        is free (members run their splits in the plan's order)."""
        ready = [0.0] * self.world_size
        times = []
        for split in self.splits:
            start = max(ready[r] for r in split.ranks)
            end = start + self.member_cost(split)
            for r in split.ranks:
                ready[r] = end
            times.append((start, end))
        return times

    def rank_finish(self) -> list[float]:
        """When each rank is done under the cost model: its splits (waits included), then its whole ones."""
        ready = [0.0] * self.world_size
        for split, (_, end) in zip(self.splits, self.split_schedule()):
            for r in split.ranks:
                ready[r] = end
        return [ready[r] + sum(self.whole_cost(batch) for batch in self.whole[r]) for r in range(self.world_size)]

    def rank_costs(self) -> list[float]:
        """Each rank's busy time under the cost model (no waits)."""
        busy = [sum(self.whole_cost(batch) for batch in batches) for batches in self.whole]
        for split in self.splits:
            for r in split.ranks:
                busy[r] += self.member_cost(split)
        return busy

    def step_cost(self) -> float:
        """Ranks meet only at the step: the last rank's finish."""
        return max(self.rank_finish(), default=0.0)

    def useful_cost(self) -> float:
        """Every sample once, whole, without fixed costs: the work any plan must do."""
        return sum(self.cost.compute.sample_costs(self.lengths))

    def idle_fraction(self) -> float:
        """``1 - useful / (ranks × step)``: waiting, all-to-alls and fixed costs all count as idle."""
        step = self.step_cost()
        return 0.0 if step == 0 else 1.0 - self.useful_cost() / (self.world_size * step)

    def whole_cost(self, batch: Sequence[int]) -> float:
        return self.cost.whole([self.lengths[i] for i in batch])

    def validate(self) -> None:
        """Every sample once; groups aligned, inside a node and in the world; every member's share and every
        whole micro-batch under the cap; no empty micro-batch."""
        if self.world_size < 1:
            raise ODCError("a split plan needs at least one rank")
        seen = sorted([i for s in self.splits for i in s.samples] + [i for r in self.whole for b in r for i in b])
        if seen != list(range(len(self.lengths))):
            raise ODCError(f"{self.policy} plan does not place every sample exactly once")
        for split in self.splits:
            p = split.group_size
            if p < 2 or p & (p - 1) or split.group_index not in aligned_groups(self.world_size, self.node_size, p):
                raise ODCError(f"{self.policy} plan: samples {split.samples} on group {split.group_index} of {p} "
                               f"ranks, not an aligned power-of-two group inside a node of {self.node_size}")
            tokens = sum(self.lengths[i] for i in split.samples)
            if not split.samples or math.ceil(tokens / p) > self.token_cap:  # [Note: a member's share]
                raise ODCError(f"{self.policy} plan: split micro-batch {split.samples} gives each of {p} members "
                               f"{math.ceil(tokens / p)} tokens (cap {self.token_cap})")
        for rank, batches in enumerate(self.whole):
            for m, batch in enumerate(batches):
                tokens = sum(self.lengths[i] for i in batch)
                if not batch or tokens > self.token_cap:
                    raise ODCError(f"{self.policy} plan: rank {rank} micro-batch {m} has {len(batch)} samples, "
                                   f"{tokens} tokens (cap {self.token_cap})")
