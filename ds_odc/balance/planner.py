"""Plans for one global minibatch: which samples each rank runs, packed into which micro-batches.

Three policies, all deterministic for a given seed and computed identically on every rank (no
communication: every rank plans the whole minibatch and keeps its own share):

- ``lb-mini`` (ODC only): balance each rank's *total* cost; each rank packs its share with its own
  fewest micro-batches, so ranks may run different numbers of them.
- ``lb-micro`` (any engine, the strong baseline for ZeRO-3): equal sample counts per rank, the same
  number of micro-batches on every rank, micro-batch i of every rank about the i-th heaviest, so
  ranks that meet at every layer wait for each other as little as possible.
- ``local-sort``: samples dealt round-robin, each rank sorts its share by length, one sample per
  micro-batch.

A :class:`Plan` also knows what a step costs under each communication scheme, from its cost model:
a collective engine meets at every micro-batch, so its step is ``Σ_m max_rank cost(rank, m)``; ODC
meets only at the step, so its step is ``max_rank Σ_m cost(rank, m)``.

Micro-batches are priced the way the data collator builds them (``padding``):

- ``packed`` (the default; a flattening collator, variable-length attention): ``Σ s`` tokens, cost
  ``per_micro_batch + Σ sample_cost(s)``.
- ``padded`` (HF ``DataCollatorWithPadding``): every sample is padded to the longest one, L (rounded
  up to ``pad_to_multiple_of``), so ``n·L`` tokens and cost ``per_micro_batch + n·sample_cost(L)``.
  Each rank then packs its samples as runs of similar lengths (:func:`~ds_odc.balance.packing.pack_padded`),
  since mixing a long sample with short ones pays for the long one on every row.

LB-Mini and LB-Micro balance ranks the same way for both; the collator's
:class:`~ds_odc.balance.packing.Packer` packs each rank's share, brings ranks to one micro-batch
count, and prices a micro-batch.

>>> plan = plan_minibatch([8, 7, 2, 2], world_size=1, token_cap=16, padding="padded")
>>> plan.for_rank(0), plan.micro_batch_tokens(), plan.micro_batch_costs()
([[0, 1], [2, 3]], [[16, 4]], [[16.0, 4.0]])
>>> plan_minibatch([8, 7, 2, 2], world_size=1, token_cap=16).micro_batch_tokens()  # packed: balanced by cost
[[10, 9]]
"""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from ds_odc.balance.cost import CostModel
from ds_odc.balance.packing import (
    Packer,
    check_lengths,
    check_padding,
    micro_batch_cost,
    micro_batch_tokens,
    packer_for,
    padded_length,
)
from ds_odc.balance.partition import karmarkar_karp, refine
from ds_odc.errors import ODCError

POLICIES = ("lb-mini", "lb-micro", "local-sort")


@dataclasses.dataclass(frozen=True)
class Plan:
    """``micro_batches[rank][m]`` lists the indices (into ``lengths``) of micro-batch m of ``rank``;
    ``padding`` and ``pad_to_multiple_of`` say how the collator builds (and so how to price) each one."""

    policy: str
    lengths: tuple[int, ...]
    token_cap: int
    cost_model: CostModel
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    padding: str = "packed"
    pad_to_multiple_of: int = 1

    def __post_init__(self):
        check_padding(self.padding, self.pad_to_multiple_of)

    @property
    def world_size(self) -> int:
        return len(self.micro_batches)

    def for_rank(self, rank: int) -> list[list[int]]:
        return [list(batch) for batch in self.micro_batches[rank]]

    def micro_batch_counts(self) -> list[int]:
        return [len(batches) for batches in self.micro_batches]

    def micro_batch_tokens(self) -> list[list[int]]:
        """Per rank, per micro-batch: the tokens the collator produces (``Σ s`` packed, ``n·L`` padded)."""
        return [[micro_batch_tokens([self.lengths[i] for i in batch], self.padding, self.pad_to_multiple_of)
                 for batch in batches] for batches in self.micro_batches]

    def micro_batch_costs(self) -> list[list[float]]:
        model, padding, multiple = self.cost_model, self.padding, self.pad_to_multiple_of
        return [[micro_batch_cost([self.lengths[i] for i in batch], model, padding, multiple) for batch in batches]
                for batches in self.micro_batches]

    def rank_costs(self) -> list[float]:
        return [sum(costs) for costs in self.micro_batch_costs()]

    def odc_step_cost(self) -> float:
        """Ranks meet only at the step: the busiest rank's total."""
        return max(self.rank_costs(), default=0.0)

    def collective_step_cost(self) -> float:
        """Ranks meet at every micro-batch: the slowest rank of each micro-batch index, summed
        (a rank with fewer micro-batches is padded with empty ones, as a collective engine must)."""
        costs = self.micro_batch_costs()
        depth = max((len(c) for c in costs), default=0)
        return sum(max(c[m] if m < len(c) else 0.0 for c in costs) for m in range(depth))

    def bubble_rate(self, collective: bool) -> float:
        """Idle fraction of rank-time the cost model predicts (communication not counted)."""
        step = self.collective_step_cost() if collective else self.odc_step_cost()
        if step == 0:
            return 0.0
        return 1.0 - sum(self.rank_costs()) / (self.world_size * step)

    def validate(self) -> None:
        """Every sample placed exactly once, every micro-batch non-empty and under the cap (in the
        tokens the plan's collator produces: padding counts)."""
        seen = sorted(i for batches in self.micro_batches for batch in batches for i in batch)
        if seen != list(range(len(self.lengths))):
            raise ODCError(f"{self.policy} plan does not place every sample exactly once")
        for rank, (batches, tokens_of) in enumerate(zip(self.micro_batches, self.micro_batch_tokens())):
            for m, (batch, tokens) in enumerate(zip(batches, tokens_of)):
                if not batch or tokens > self.token_cap:
                    raise ODCError(f"{self.policy} plan: rank {rank} micro-batch {m} has {len(batch)} samples, "
                                   f"{tokens} {'padded ' if self.padding == 'padded' else ''}tokens "
                                   f"(cap {self.token_cap})")


def plan_minibatch(lengths: Sequence[int], world_size: int, token_cap: int, policy: str = "lb-mini",
                   cost_model: CostModel | None = None, seed: int = 0, padding: str = "packed",
                   pad_to_multiple_of: int = 1) -> Plan:
    """Plan one global minibatch (``lengths`` of all its samples) for ``world_size`` ranks, pricing
    micro-batches as ``padding`` says (``"packed"`` or ``"padded"``, see the module docstring)."""
    lengths = tuple(int(s) for s in lengths)
    if policy not in POLICIES:
        raise ODCError(f"unknown balancing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if world_size < 1:
        raise ODCError(f"world_size must be >= 1, got {world_size}")
    check_padding(padding, pad_to_multiple_of)
    check_lengths(lengths, token_cap, pad_to_multiple_of)
    model = cost_model or CostModel.tokens()
    # padded, a sample costs at least what it costs as the longest of its micro-batch: balance on that
    costs = model.sample_costs([padded_length(s, pad_to_multiple_of) for s in lengths])
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)  # the seed decides ties between equal costs
    if policy == "local-sort":
        shares = [sorted(range(rank, len(lengths), world_size), key=lambda i: (-lengths[i], i))
                  for rank in range(world_size)]
        batches = [[[i] for i in share] for share in shares]
    else:
        packer = packer_for(padding, lengths, costs, token_cap, order, model, pad_to_multiple_of)
        balance = lb_micro if policy == "lb-micro" else lb_mini
        batches = balance(costs, world_size, order, packer)
    plan = Plan(policy, lengths, token_cap, model, tuple(tuple(tuple(b) for b in r) for r in batches), padding,
                pad_to_multiple_of)
    plan.validate()
    return plan


def lb_mini(costs: Sequence[float], world_size: int, order: Sequence[int], packer: Packer) -> list[list[list[int]]]:
    """Balance totals with and without equal counts, pack each rank on its own, and keep the best
    plan by the ODC step cost *including* each micro-batch's fixed cost and padding (which packing
    decides); LB-Micro's plan is a candidate too, so LB-Mini is never worse than it for ODC.
    ``packer`` says how the collator builds a micro-batch (:class:`~ds_odc.balance.packing.Packer`).

    >>> from ds_odc.balance.packing import PackedPacker
    >>> lengths, order = [9, 1, 1, 1], [0, 1, 2, 3]  # tokens model: a sample costs its length
    >>> packer = PackedPacker(lengths, costs=lengths, token_cap=16, order=order, model=CostModel.tokens())
    >>> lb_mini(lengths, 2, order, packer)  # ranks cost 9 and 3 (LB-Micro, below: 10 and 2)
    [[[0]], [[1, 2, 3]]]
    """
    unequal = _balanced_shares(costs, world_size, order, equal_size=False)
    _give_every_rank_a_sample(unequal, costs)
    equal = _balanced_shares(costs, world_size, order, equal_size=True)
    candidates = [[packer.pack(share) for share in shares] for shares in (unequal, equal)]
    candidates.append(packer.same_count(equal))
    return min(candidates, key=lambda plan: _odc_cost_key(plan, packer.price))


def lb_micro(costs: Sequence[float], world_size: int, order: Sequence[int], packer: Packer) -> list[list[list[int]]]:
    """Equal sample counts per rank (balanced by cost), then the same micro-batch count on every rank.

    >>> from ds_odc.balance.packing import PackedPacker
    >>> lengths, order = [9, 1, 1, 1], [0, 1, 2, 3]
    >>> packer = PackedPacker(lengths, costs=lengths, token_cap=16, order=order, model=CostModel.tokens())
    >>> lb_micro(lengths, 2, order, packer)  # two samples and one micro-batch each: ranks cost 10 and 2
    [[[0, 3]], [[1, 2]]]
    """
    return packer.same_count(_balanced_shares(costs, world_size, order, equal_size=True))


def _balanced_shares(costs, world_size, order, equal_size):
    shares = karmarkar_karp(costs, world_size, equal_size=equal_size, order=order)
    return refine(costs, shares, equal_size=equal_size)


def _odc_cost_key(batches, price):
    """The busiest rank's total, then the spread between ranks (of two plans as slow, the more even)."""
    totals = [sum(price(batch) for batch in rank) for rank in batches]
    return (max(totals), max(totals) - min(totals))


def _give_every_rank_a_sample(shares, costs):
    """An unconstrained split may leave a rank with nothing when one sample dwarfs the rest; a rank
    with no micro-batch still steps, but there is no reason to idle it when samples allow."""
    for share in shares:
        if not share:
            donor = max(shares, key=len)
            if len(donor) < 2:
                return
            cheapest = min(donor, key=lambda i: costs[i])
            donor.remove(cheapest)
            share.append(cheapest)
