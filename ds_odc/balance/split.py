"""Split only the long samples: per step, which samples run over a Ulysses group and over how many
ranks, and LB-Mini for the rest (policy ``"lb-mini-split"``; the plan's types: :mod:`ds_odc.balance.split_plan`).

Why: LB-Mini balances whole samples, so its step is at least the longest sample's cost. With one or
two samples per rank on long-tailed lengths that one sample costs more than an average rank's whole
share, and every other rank waits for it. Splitting it over a group of ranks (each member runs it for
``1/p`` of the heads and ``1/p`` of the tokens: :mod:`ds_odc.balance.split_cost`) divides its cost;
splitting every sample (fixed sequence parallelism) pays the all-to-alls on short samples too. This
planner splits what shortens the step.

The plan, for a given minibatch, world, node size and seed, is computed by every rank alone, with no
communication, and is the same on every rank (a pure function; ties go by the seeded order):

- **Groups** are aligned powers of two inside a node (:func:`~ds_odc.balance.split_plan.aligned_groups`),
  ``p`` in 2, 4, 8 up to ``max_group`` (the model's heads must divide by it:
  :func:`~ds_odc.balance.split_plan.max_group_for_heads`). All the groups a job can use are known at
  start: at most three per rank, on the node's fast links.
- **Order.** Every rank runs its split micro-batches first, in the plan's one order (``splits``), then
  its own whole ones. Larger groups come first, and each size level is placed on blocks whose members
  are, in the cost model, free at the same moment (a block of ``p`` lies inside one block of every larger
  size), so nobody waits for a partner.
- **No deadlock, whatever the real times.** Every rank runs the split micro-batches it belongs to in the
  order of one global list. Of those some rank is waiting in, take the earliest in the list: each of its
  members has finished every earlier one it belongs to, so each has reached it, and it runs.
- **Candidates**, each priced by its step under the cost model (the last rank's finish):

  1. LB-Mini on whole samples (:func:`~ds_odc.balance.planner.plan_minibatch`), where every sample fits the cap;
  2. for each allowed size ``p`` whose groups tile the world, fixed SP: every sample over a group, LB-Mini
     over the ``world / p`` groups with packed micro-batches (so the plan is never worse than fixed SP);
  3. single samples split: by thresholds ``τ`` around the ideal share (total cost / ranks), a sample whose
     whole cost is above ``τ`` runs over the smallest group that brings a member's cost under ``τ``; the
     splits are placed level by level (largest first onto the block free earliest, then
     :func:`~ds_odc.balance.partition.refine` between blocks), the whole samples balanced onto what is left
     of every rank the same way, then packed as LB-Mini packs. A local search from the best few changes
     the group size (whole included) of one sample on the busiest rank at a time while the step shortens.

  The shortest candidate is taken if it is at least ``min_gain`` shorter than LB-Mini's, so the step is
  never worse than LB-Mini's under the same cost model.
- **Not split:** a micro-batch whose members would hold fewer than ``min_chunk_tokens`` tokens each; and
  nothing at all in a minibatch without a long sample (one of at least ``2 × min_chunk_tokens``). Once
  some sample is long, a fixed-SP layout may carry short samples along, packed into its split micro-batches.
- **Longer than the cap:** ``token_cap`` is what one rank's activations hold, so a sample longer than it is
  always split, over at least the smallest group that brings each member under the cap (a member holds
  ``ceil(tokens / p)``: :func:`~ds_odc.balance.split_plan.smallest_groups`), whatever ``min_chunk_tokens``
  and ``min_gain`` prefer: LB-Mini on whole samples is then no candidate, fixed SP only over groups that
  hold every sample, and the search keeps such a sample split (over a larger group where
  ``min_chunk_tokens`` allows it). A sample longer than the largest group holds (``max_group × token_cap``,
  or less where the world or the node has no group that large) is refused, naming it.

Worked example: 4 ranks, cost = tokens, all-to-alls 0.1 per token over 4 ranks. One sample of 8000
tokens and seven of 1000 are 15000 tokens, 3750 a rank; LB-Mini gives one rank the 8000 (idle 53%).
Over ranks 0-3 it costs each 2000 + 800 of all-to-alls, and the seven others fill up to 4800 (fixed SP
4 would cost each 3750 + 1500):

>>> from ds_odc.balance.split_cost import AllToAllCost
>>> a2a = AllToAllCost(layers=1, all_to_alls_per_layer=1, bytes_per_token=16.0, bandwidth=30.0, latency=0.0)
>>> plan = plan_split([8000] + [1000] * 7, world_size=4, token_cap=8000, all_to_all=a2a, node_size=4,
...                   min_chunk_tokens=1000)
>>> plan.splits
(SplitMicroBatch(samples=(0,), group_size=4, group_index=0),)
>>> for rank in range(4):  # split micro-batches first (every member the same), then its own
...     print(rank, [(mb.samples, mb.ranks, mb.part(rank)) for mb in plan.for_rank(rank)])
0 [((0,), (0, 1, 2, 3), 0), ((3, 4), (0,), 0)]
1 [((0,), (0, 1, 2, 3), 1), ((1, 7), (1,), 0)]
2 [((0,), (0, 1, 2, 3), 2), ((5, 6), (2,), 0)]
3 [((0,), (0, 1, 2, 3), 3), ((2,), (3,), 0)]
>>> plan.step_cost(), round(plan.idle_fraction(), 3)
(4800.0, 0.219)

With a cap of 4000 tokens, a sample of 6000 cannot run whole: it runs over ranks 0-1, 3000 tokens each,
although ``min_chunk_tokens`` asks for 4096 (each member pays 3000 + 800 of all-to-alls), and ranks 2-3 pair
up the four others. 20000 tokens are more than the largest group (4 ranks) holds: refused.

>>> plan = plan_split([6000] + [2000] * 4, world_size=4, token_cap=4000, all_to_all=a2a, node_size=4,
...                   min_chunk_tokens=4096)
>>> [(s.samples, s.ranks) for s in plan.splits], [len(batches) for batches in plan.whole], plan.step_cost()
([((0,), (0, 1))], [0, 0, 1, 1], 4000.0)
>>> plan_split([20000, 2000], world_size=4, token_cap=4000, node_size=4)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ds_odc.errors.ODCError: sample 0 has 20000 tokens, more than token_cap=4000 × 4 ranks = 16000 tokens, ...
"""
from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from ds_odc.arguments import require_whole_number
from ds_odc.balance.cost import CostModel
from ds_odc.balance.packing import PackedPacker, minimal_micro_batches
from ds_odc.balance.partition import refine
from ds_odc.balance.planner import plan_minibatch
from ds_odc.balance.split_cost import AllToAllCost, SplitCostModel
from ds_odc.balance.split_plan import SplitMicroBatch, SplitPlan, aligned_groups, group_sizes, smallest_groups
from ds_odc.errors import ODCError

#: Candidate thresholds, as multiples of the ideal share (total cost / ranks).
THRESHOLDS = tuple(2.0 ** (k / 4) for k in range(-8, 5))
LOCAL_SEARCH_ROUNDS = 32
SEARCH_STARTS = 3
MOVES_PER_KIND = 4
REFINE_ROUNDS = 4


def plan_split(lengths: Sequence[int], world_size: int, token_cap: int, cost_model: CostModel | None = None,
               all_to_all: AllToAllCost | None = None, node_size: int = 8, max_group: int = 8,
               min_chunk_tokens: int = 2048, min_gain: float = 0.01, seed: int = 0) -> SplitPlan:
    """Plan one global minibatch with long samples split over aligned groups (see the module docstring).

    ``cost_model`` prices compute (default: token counts) and ``all_to_all`` Ulysses' communication
    (default :class:`~ds_odc.balance.split_cost.AllToAllCost`, in seconds: pass both in one unit).
    ``node_size``: ranks per node (groups never cross one). ``max_group``: the largest group (2, 4 or 8;
    :func:`~ds_odc.balance.split_plan.max_group_for_heads` of the model). ``token_cap``: tokens per rank
    in a micro-batch (a split one holds up to ``group size × token_cap``; a sample longer than the cap is
    always split, one longer than the largest group holds is refused). ``min_chunk_tokens``: the fewest
    tokens a member of a split micro-batch may hold (default 2048, an assumption: the cost model prices
    compute per token and does not see that much shorter slices leave the GEMMs short of full efficiency;
    2048 tokens × the 1.5B model's hidden 1536 still fill a GPU), so no sample shorter than
    ``2 × min_chunk_tokens`` is split on its own (unless it is longer than the cap). ``min_gain`` (default 1%,
    about the cost model's own error): the least relative shortening of LB-Mini's step for which a split plan
    is taken (where a sample is longer than the cap LB-Mini has no plan, and the best split one is taken)."""
    lengths = tuple(int(s) for s in lengths)
    for name, value in (("world_size", world_size), ("node_size", node_size), ("max_group", max_group),
                        ("min_chunk_tokens", min_chunk_tokens)):
        require_whole_number(f"plan_split: {name}", value, 1)
    if not 0.0 <= min_gain < 1.0:
        raise ODCError(f"plan_split: min_gain must be in [0, 1), got {min_gain}")
    forced = smallest_groups(lengths, token_cap, world_size, node_size, max_group)
    model = cost_model or CostModel.tokens()
    cost = SplitCostModel(model, all_to_all or AllToAllCost())
    sizes = group_sizes(world_size, node_size, max_group)
    if forced:  # no whole-sample plan exists: the best split one, whatever min_gain or min_chunk_tokens say
        best = _best_split(lengths, world_size, token_cap, cost, node_size, sizes, min_chunk_tokens, seed, forced)
    else:
        best = _lb_mini_or_better(lengths, world_size, token_cap, cost, node_size, sizes, min_chunk_tokens,
                                  min_gain, seed)
    best.validate()
    return best


def _lb_mini_or_better(lengths, world_size, token_cap, cost: SplitCostModel, node_size, sizes, min_chunk_tokens,
                       min_gain, seed) -> SplitPlan:
    """Every sample fits whole: LB-Mini's plan, unless a split plan is at least ``min_gain`` shorter."""
    model = cost.compute
    whole_only = plan_minibatch(lengths, world_size, token_cap, "lb-mini", model, seed=seed)
    best = SplitPlan(lengths, token_cap, cost, node_size, (), whole_only.micro_batches)
    # no plan's step is shorter than the useful work spread evenly: LB-Mini at that bound cannot be beaten
    bound = sum(model.sample_costs(lengths)) / world_size
    long_sample = any(s >= 2 * min_chunk_tokens for s in lengths)  # splitting exists to cut long samples
    if sizes and long_sample and best.step_cost() * (1.0 - min_gain) > bound:
        candidate = _best_split(lengths, world_size, token_cap, cost, node_size, sizes, min_chunk_tokens, seed, {})
        if candidate.step_cost() < best.step_cost() * (1.0 - min_gain):
            best = candidate
    return best


def _best_split(lengths, world_size, token_cap, cost: SplitCostModel, node_size, sizes, min_chunk_tokens, seed,
                forced: dict[int, int]) -> SplitPlan:
    """The shortest of fixed SP of each size that holds every sample and the search (candidates 2 and 3),
    each splitting every ``forced`` sample over at least its smallest group."""
    candidates = [plan for p in sizes
                  if (plan := fixed_groups(lengths, world_size, token_cap, cost, node_size, p, min_chunk_tokens,
                                           seed)) is not None]
    candidates.append(_Search(lengths, world_size, token_cap, cost, node_size, sizes, min_chunk_tokens, seed,
                              forced).run())
    return min(candidates, key=lambda plan: (plan.step_cost(), sum(plan.rank_costs())))


def fixed_groups(lengths: Sequence[int], world_size: int, token_cap: int, cost: SplitCostModel, node_size: int,
                 group_size: int, min_chunk_tokens: int = 1, seed: int = 0) -> SplitPlan | None:
    """Fixed SP as a split plan: every sample over a group of ``group_size``, LB-Mini over the groups with
    packed micro-batches of up to ``group_size × token_cap`` tokens, priced per member
    (:meth:`~ds_odc.balance.split_cost.SplitCostModel.fixed_group_model`). None where the aligned groups do
    not tile the world, a sample is longer than ``group_size × token_cap`` ([Note: a member's share] in
    :func:`~ds_odc.balance.split_plan.smallest_group`), or a micro-batch would give a member fewer than
    ``min_chunk_tokens`` tokens (unless it holds a sample that needs this group size: one longer than
    ``group_size / 2 × token_cap``, which no smaller group holds, so the cap overrides the preference).

    >>> from ds_odc.balance.split_cost import AllToAllCost
    >>> plan = fixed_groups([6, 2, 4, 4], 4, 8, SplitCostModel(CostModel.tokens(), AllToAllCost.free()), 4, 2)
    >>> [(s.samples, s.ranks) for s in plan.splits], plan.step_cost()
    ([((0, 1), (0, 1)), ((2, 3), (2, 3))], 4.0)
    """
    groups = aligned_groups(world_size, node_size, group_size)
    if len(groups) * group_size != world_size or max(lengths, default=0) > group_size * token_cap:
        return None
    model = cost.fixed_group_model(group_size)
    plan = plan_minibatch(lengths, len(groups), token_cap * group_size, "lb-mini", model, seed=seed)
    splits = tuple(SplitMicroBatch(tuple(batch), group_size, g)
                   for g, batches in zip(groups, plan.micro_batches) for batch in batches)
    needs_this_size = [2 * s > group_size * token_cap for s in lengths]
    if any(sum(lengths[i] for i in split.samples) < group_size * min_chunk_tokens
           and not any(needs_this_size[i] for i in split.samples) for split in splits):
        return None
    return SplitPlan(tuple(lengths), token_cap, cost, node_size, splits, tuple(() for _ in range(world_size)))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A searched candidate before packing: splits in order, each rank's whole samples, and its key."""

    splits: tuple[SplitMicroBatch, ...]
    shares: tuple[tuple[int, ...], ...]
    key: tuple[float, int, float]
    finish: tuple[float, ...]


class _Search:
    """Candidates of the third kind: a choice maps a sample to its group size (absent: whole). A ``forced``
    sample (longer than the cap: index -> its smallest group) is in every choice, over that group or a larger
    one that ``min_chunk_tokens`` allows."""

    def __init__(self, lengths, world_size, token_cap, cost: SplitCostModel, node_size, sizes, min_chunk_tokens,
                 seed, forced: dict[int, int]):
        self.lengths, self.world_size, self.cost, self.node_size = lengths, world_size, cost, node_size
        self.token_cap, self.sizes, self.forced = token_cap, sizes, forced
        self.order = list(range(len(lengths)))
        random.Random(seed).shuffle(self.order)  # the seed decides ties, as in plan_minibatch
        self.position = {item: p for p, item in enumerate(self.order)}
        self.costs = cost.compute.sample_costs(lengths)
        self.allowed = [[p for p in sizes if p == forced.get(i) or (p > forced.get(i, 1) and s >= p * min_chunk_tokens)]
                        for i, s in enumerate(lengths)]
        self.groups = {p: aligned_groups(world_size, node_size, p) for p in sizes}
        self.layouts: dict[tuple, _Layout] = {}
        self.refine_rounds: int | None = REFINE_ROUNDS  # while searching: a bounded polish

    def run(self) -> SplitPlan:
        """Threshold choices and every splittable sample over one size; a local search from the best few;
        the best layout, packed."""
        ideal = sum(self.costs) / self.world_size
        starts = [self.by_threshold(ideal * factor) for factor in THRESHOLDS]
        starts += [self.with_forced({i: max(q for q in sizes if q <= p)
                                     for i, sizes in enumerate(self.allowed) if sizes and sizes[0] <= p})
                   for p in self.sizes]
        unique = {tuple(sorted(choice.items())): choice for choice in starts}
        ranked = sorted(unique.values(), key=lambda choice: self.layout(choice).key)
        best = min((self.improve(choice) for choice in ranked[:SEARCH_STARTS]), key=lambda layout: layout.key)
        self.refine_rounds, self.layouts = None, {}  # the winner, balanced to the end
        best = self.layout({i: s.group_size for s in best.splits for i in s.samples})
        packer = PackedPacker(self.lengths, self.costs, self.token_cap, self.order, self.cost.compute)
        whole = tuple(tuple(tuple(batch) for batch in packer.pack(share)) for share in best.shares)
        return SplitPlan(self.lengths, self.token_cap, self.cost, self.node_size, best.splits, whole)

    def by_threshold(self, tau: float) -> dict[int, int]:
        """Samples whole up to ``tau``; above it, over the smallest group that brings a member under it."""
        choice = {}
        for i, length in enumerate(self.lengths):
            if self.costs[i] <= tau or not self.allowed[i]:
                continue
            fits = [p for p in self.allowed[i] if self.cost.member(length, p) <= tau]
            choice[i] = fits[0] if fits else self.allowed[i][-1]
        return self.with_forced(choice)

    def with_forced(self, choice: dict[int, int]) -> dict[int, int]:
        """``choice`` with every forced sample it leaves whole over its smallest group."""
        return {**self.forced, **choice}

    def improve(self, choice: dict[int, int]) -> _Layout:
        """Give one sample that loads the busiest rank another group size (whole included), keeping the
        best such change, while the key improves."""
        layout = self.layout(choice)
        for _ in range(LOCAL_SEARCH_ROUNDS):
            busiest = max(range(self.world_size), key=lambda r: (layout.finish[r], -r))
            candidates = (self.heaviest(layout.shares[busiest])
                          + self.heaviest(i for s in layout.splits if busiest in s.ranks for i in s.samples))
            moves = []
            for i in candidates:
                for p in ([] if i in self.forced else [1]) + self.allowed[i]:  # a forced sample is never whole
                    if p != choice.get(i, 1):
                        move = {k: v for k, v in choice.items() if k != i}
                        if p > 1:
                            move[i] = p
                        moves.append(move)
            if not moves:
                break
            move = min(moves, key=lambda m: self.layout(m).key)
            if self.layout(move).key >= layout.key:
                break
            choice, layout = move, self.layout(move)
        return layout

    def heaviest(self, items) -> list[int]:
        return sorted(items, key=lambda i: (-self.costs[i], self.position[i]))[:MOVES_PER_KIND]

    def layout(self, choice: dict[int, int]) -> _Layout:
        """Place the splits level by level, balance the whole samples onto what is left, and key the result:
        the step first; as long, fewer ranks finishing last (the next change can then shorten it); then
        less busy time (fewer all-to-alls). Whole samples are priced packed into the fewest micro-batches
        the cap allows (packing itself waits for the winner)."""
        frozen = tuple(sorted(choice.items()))
        if frozen in self.layouts:
            return self.layouts[frozen]
        ready = [0.0] * self.world_size
        busy = 0.0
        splits: list[SplitMicroBatch] = []
        for p in sorted(set(choice.values()), reverse=True):
            items = [i for i in choice if choice[i] == p]
            member = {i: self.cost.member(self.lengths[i], p) for i in items}
            blocks = self.balance_onto(items, member, [ready[g * p] for g in self.groups[p]])
            for g, block in zip(self.groups[p], blocks):
                for i in self.heaviest_all(block):
                    splits.append(SplitMicroBatch((i,), p, g))
                    busy += p * member[i]
                ready[g * p:(g + 1) * p] = [ready[g * p] + sum(member[i] for i in block)] * p
        shares = self.balance_onto([i for i in range(len(self.lengths)) if i not in choice], self.costs, ready)
        fixed = self.cost.compute.per_micro_batch
        finish = []
        for rank, share in enumerate(shares):
            micro_batches = minimal_micro_batches(share, self.lengths, self.token_cap)
            work = sum(self.costs[i] for i in share) + fixed * micro_batches
            busy += work
            finish.append(ready[rank] + work)
        step = max(finish)
        at_step = sum(1 for f in finish if f >= step * (1 - 1e-9))
        result = _Layout(tuple(splits), tuple(tuple(share) for share in shares), (step, at_step, busy), tuple(finish))
        self.layouts[frozen] = result
        return result

    def heaviest_all(self, items) -> list[int]:
        return sorted(items, key=lambda i: (-self.costs[i], self.position[i]))

    def balance_onto(self, items: list[int], costs, base: list[float]) -> list[list[int]]:
        """``items`` (priced by ``costs[i]``) onto parts already loaded with ``base``: largest first onto the
        least loaded, then moves and swaps while the busiest part gets lighter."""
        loads = list(base)
        parts: list[list[int]] = [[] for _ in base]
        for i in self.heaviest_all(items):
            part = min(range(len(loads)), key=lambda k: (loads[k], k))
            parts[part].append(i)
            loads[part] += costs[i]
        if not items:
            return parts
        local = sorted(items)
        index = {i: k for k, i in enumerate(local)}
        refined = refine([costs[i] for i in local], [[index[i] for i in part] for part in parts],
                         max_rounds=self.refine_rounds, base=base)
        return [[local[k] for k in part] for part in refined]
