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
"""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from ds_odc.balance.cost import CostModel
from ds_odc.balance.packing import check_lengths, minimal_micro_batches, pack, split_into
from ds_odc.balance.partition import karmarkar_karp, refine
from ds_odc.errors import ODCError

POLICIES = ("lb-mini", "lb-micro", "local-sort")


@dataclasses.dataclass(frozen=True)
class Plan:
    """``micro_batches[rank][m]`` lists the indices (into ``lengths``) of micro-batch m of ``rank``."""

    policy: str
    lengths: tuple[int, ...]
    token_cap: int
    cost_model: CostModel
    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.micro_batches)

    def for_rank(self, rank: int) -> list[list[int]]:
        return [list(batch) for batch in self.micro_batches[rank]]

    def micro_batch_counts(self) -> list[int]:
        return [len(batches) for batches in self.micro_batches]

    def micro_batch_costs(self) -> list[list[float]]:
        model = self.cost_model
        return [[model.micro_batch_cost([self.lengths[i] for i in batch]) for batch in batches]
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
        """Every sample placed exactly once, every micro-batch non-empty and under the cap."""
        seen = sorted(i for batches in self.micro_batches for batch in batches for i in batch)
        if seen != list(range(len(self.lengths))):
            raise ODCError(f"{self.policy} plan does not place every sample exactly once")
        for rank, batches in enumerate(self.micro_batches):
            for m, batch in enumerate(batches):
                tokens = sum(self.lengths[i] for i in batch)
                if not batch or tokens > self.token_cap:
                    raise ODCError(f"{self.policy} plan: rank {rank} micro-batch {m} has {len(batch)} samples, "
                                   f"{tokens} tokens (cap {self.token_cap})")


def plan_minibatch(lengths: Sequence[int], world_size: int, token_cap: int, policy: str = "lb-mini",
                   cost_model: CostModel | None = None, seed: int = 0) -> Plan:
    """Plan one global minibatch (``lengths`` of all its samples) for ``world_size`` ranks."""
    lengths = tuple(int(s) for s in lengths)
    if policy not in POLICIES:
        raise ODCError(f"unknown balancing policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if world_size < 1:
        raise ODCError(f"world_size must be >= 1, got {world_size}")
    check_lengths(lengths, token_cap)
    model = cost_model or CostModel.tokens()
    costs = model.sample_costs(lengths)
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)  # the seed decides ties between equal costs
    if policy == "local-sort":
        shares = [sorted(range(rank, len(lengths), world_size), key=lambda i: (-lengths[i], i))
                  for rank in range(world_size)]
        batches = [[[i] for i in share] for share in shares]
    elif policy == "lb-micro":
        batches = _lb_micro(lengths, costs, world_size, token_cap, order)
    else:
        batches = _lb_mini(lengths, costs, world_size, token_cap, order, model)
    plan = Plan(policy, lengths, token_cap, model, tuple(tuple(tuple(b) for b in r) for r in batches))
    plan.validate()
    return plan


def _balanced_shares(costs, world_size, order, equal_size):
    shares = karmarkar_karp(costs, world_size, equal_size=equal_size, order=order)
    return refine(costs, shares, equal_size=equal_size)


def _lb_mini(lengths, costs, world_size, token_cap, order, model):
    """Balance totals with and without equal counts, pack each rank on its own, and keep the best
    plan by the ODC step cost *including* each micro-batch's fixed cost (which packing decides);
    LB-Micro's plan is a candidate too, so LB-Mini is never worse than it for ODC."""
    unequal = _balanced_shares(costs, world_size, order, equal_size=False)
    _give_every_rank_a_sample(unequal, costs)
    equal = _balanced_shares(costs, world_size, order, equal_size=True)
    candidates = [[pack(share, lengths, costs, token_cap, order) for share in shares] for shares in (unequal, equal)]
    candidates.append(_pack_same_count(equal, lengths, costs, token_cap, order))
    return min(candidates, key=lambda plan: _odc_cost_key(plan, costs, model))


def _odc_cost_key(batches, costs, model):
    totals = [sum(sum(costs[i] for i in batch) + model.per_micro_batch for batch in rank) for rank in batches]
    return (max(totals), max(totals) - min(totals))


def _lb_micro(lengths, costs, world_size, token_cap, order):
    return _pack_same_count(_balanced_shares(costs, world_size, order, equal_size=True), lengths, costs, token_cap,
                            order)


def _pack_same_count(shares, lengths, costs, token_cap, order):
    count = max(minimal_micro_batches(share, lengths, token_cap) for share in shares)
    while True:
        attempt = [split_into(share, min(count, len(share)), lengths, costs, token_cap, order) for share in shares]
        if all(batches is not None for batches in attempt):
            return attempt
        count += 1  # every rank moves to one more micro-batch together, as the counts must agree


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
