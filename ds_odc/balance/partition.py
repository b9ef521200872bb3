"""Multi-way number partitioning: Karmarkar-Karp's largest differencing, then a swap refinement.

The goal everywhere is the smallest *largest* part: a step lasts as long as the busiest rank.

Karmarkar-Karp keeps a heap of partial k-way solutions keyed by their spread (largest minus smallest
part) and repeatedly merges the two with the largest spread, pairing the heaviest part of one with the
lightest part of the other. With ``equal_size`` every initial solution holds exactly one item per part
(items taken k at a time in cost order), so every merge keeps part sizes equal.

>>> costs = [8, 7, 6, 5, 4]
>>> parts = karmarkar_karp(costs, 2)
>>> sorted(sum(costs[i] for i in p) for p in parts)  # differencing is a heuristic ...
[14, 16]
>>> sorted(sum(costs[i] for i in p) for p in refine(costs, parts))  # ... the refinement finds 15 / 15
[15, 15]
>>> [len(p) for p in karmarkar_karp([9, 1, 1, 1], 2, equal_size=True)]
[2, 2]
"""
from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import operator
from typing import Sequence

from ds_odc.errors import ODCError


def karmarkar_karp(costs: Sequence[float], parts: int, equal_size: bool = False,
                   order: Sequence[int] | None = None) -> list[list[int]]:
    """Split item indices ``0..len(costs)-1`` into ``parts`` lists. ``order`` (a permutation) breaks
    ties between equal costs deterministically; with ``equal_size`` part sizes differ by at most one."""
    collecting = gc.isenabled()
    gc.disable()  # the merges allocate many small tuples and nothing cyclic: a collection is pure pause
    try:
        return _karmarkar_karp(costs, parts, equal_size, order)
    finally:
        if collecting:
            gc.enable()


def _karmarkar_karp(costs: Sequence[float], parts: int, equal_size: bool,
                    order: Sequence[int] | None) -> list[list[int]]:
    if parts < 1:
        raise ODCError(f"karmarkar_karp: parts must be >= 1, got {parts}")
    n = len(costs)
    order = list(range(n)) if order is None else list(order)
    rank_in_order = {item: position for position, item in enumerate(order)}
    items = sorted(range(n), key=lambda i: (-costs[i], rank_in_order[i]))
    # a part is (sum, items) where items is a leaf index, None (empty) or a pair of item trees; the
    # trees are flattened once at the end, so a merge costs O(parts log parts), never a list copy
    heap: list = []
    by_sum = operator.itemgetter(0)

    counter = itertools.count()  # ties between equal spreads go to the older state: deterministic

    def push(state):
        state.sort(key=by_sum, reverse=True)
        heapq.heappush(heap, (state[-1][0] - state[0][0], next(counter), state))

    if equal_size:
        padded = items + [-1] * (-n % parts)  # zero-cost placeholders make the count divisible
        for start in range(0, len(padded), parts):
            push([(costs[i], i) if i >= 0 else (0.0, None) for i in padded[start:start + parts]])
    else:
        for i in items:
            push([(costs[i], i)] + [(0.0, None)] * (parts - 1))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        heavy = heapq.heappop(heap)[2]
        light = heapq.heappop(heap)[2]
        push([(high[0] + low[0], (high[1], low[1])) for high, low in zip(heavy, reversed(light))])
    return [sorted(_flatten(part[1])) for part in heap[0][2]]


def _flatten(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, tuple):
            stack.extend(node)
        else:
            out.append(node)
    return out


def refine(costs: Sequence[float], partition: list[list[int]], equal_size: bool = False,
           max_rounds: int | None = None, base: Sequence[float] | None = None) -> list[list[int]]:
    """Lower the largest part by moving or swapping items out of it, while it helps.

    Each round takes the heaviest part and, against every other part, looks for the single move
    (unless ``equal_size``) or swap that brings the pair closest to even without making the other
    part the new maximum; the best such change over all parts is applied. Stops when no change
    lowers the heaviest part, or after ``max_rounds`` (default: number of items).

    ``base`` (one number per part, default zeros) is load a part carries that no move can take away,
    e.g. a rank's share of the samples split over a group (:mod:`ds_odc.balance.split`):

    >>> refine([4, 3, 2], [[0, 1, 2], []], base=[0, 5])  # part 1 starts at 5: it takes only the 2
    [[0, 1], [2]]
    """
    parts = [list(p) for p in partition]
    if base is not None and len(base) != len(parts):
        raise ODCError(f"refine: base has {len(base)} entries for {len(parts)} parts")
    sums = [(base[k] if base is not None else 0.0) + sum(costs[i] for i in p) for k, p in enumerate(parts)]
    rounds = len(costs) if max_rounds is None else max_rounds
    for _ in range(rounds):
        heavy = max(range(len(parts)), key=lambda p: (sums[p], -p))
        # (new heavy sum, other part, item out of heavy, item in from other or None)
        best: tuple[float, int, int, int | None] | None = None
        heavy_sorted = sorted(parts[heavy], key=lambda i: costs[i])
        heavy_costs = [costs[i] for i in heavy_sorted]
        for other in range(len(parts)):
            if other == heavy:
                continue
            gap = sums[heavy] - sums[other]
            if gap <= 0:
                continue
            if not equal_size:  # move x: the pair becomes (H - x, O + x); best x is close to gap / 2
                position = bisect.bisect_left(heavy_costs, gap / 2)
                for candidate in (position - 1, position):
                    if 0 <= candidate < len(heavy_costs) and 0 < heavy_costs[candidate] < gap:
                        x = heavy_costs[candidate]
                        new_max = max(sums[heavy] - x, sums[other] + x)
                        if best is None or new_max < best[0]:
                            best = (new_max, other, heavy_sorted[candidate], None)
            # swap x (heavy) with y (other): delta = x - y in (0, gap); best delta close to gap / 2
            for y_item in parts[other]:
                y = costs[y_item]
                position = bisect.bisect_left(heavy_costs, y + gap / 2)
                for candidate in (position - 1, position):
                    if 0 <= candidate < len(heavy_costs):
                        delta = heavy_costs[candidate] - y
                        if 0 < delta < gap:
                            new_max = max(sums[heavy] - delta, sums[other] + delta)
                            if best is None or new_max < best[0]:
                                best = (new_max, other, heavy_sorted[candidate], y_item)
        if best is None or best[0] >= sums[heavy]:
            break
        _, other, out_item, in_item = best
        parts[heavy].remove(out_item)
        parts[other].append(out_item)
        sums[heavy] -= costs[out_item]
        sums[other] += costs[out_item]
        if in_item is not None:
            parts[other].remove(in_item)
            parts[heavy].append(in_item)
            sums[heavy] += costs[in_item]
            sums[other] -= costs[in_item]
    return [sorted(p) for p in parts]


def largest_part(costs: Sequence[float], partition: list[list[int]]) -> float:
    return max((sum(costs[i] for i in p) for p in partition), default=0.0)
