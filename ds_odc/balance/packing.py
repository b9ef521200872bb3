"""Pack one rank's samples into micro-batches under a token cap.

The fewest micro-batches is best (each costs a fixed overhead and, under ZeRO-3, a round of
collectives), so packing starts at ``ceil(tokens / cap)`` micro-batches, splits the samples between
them with Karmarkar-Karp on cost, and adds one micro-batch at a time until every one respects the
cap. One sample per micro-batch always fits (a sample longer than the cap is an error), so the loop
ends.

>>> pack([0, 1, 2, 3], lengths=[5, 4, 3, 2], costs=[5, 4, 3, 2], token_cap=7)
[[0, 3], [1, 2]]
"""
from __future__ import annotations

import math
from typing import Sequence

from ds_odc.balance.partition import karmarkar_karp
from ds_odc.errors import ODCError


def check_lengths(lengths: Sequence[int], token_cap: int) -> None:
    if token_cap < 1:
        raise ODCError(f"token_cap must be >= 1, got {token_cap}")
    for index, length in enumerate(lengths):
        if length < 1:
            raise ODCError(f"sample {index} has length {length}; every sample needs at least 1 token")
        if length > token_cap:
            raise ODCError(f"sample {index} has {length} tokens, more than token_cap={token_cap}: "
                           "raise the cap or truncate the sample")


def minimal_micro_batches(samples: Sequence[int], lengths: Sequence[int], token_cap: int) -> int:
    """The lower bound ``ceil(tokens / cap)`` (at least 1 when there are samples, 0 otherwise)."""
    if not samples:
        return 0
    return max(1, math.ceil(sum(lengths[i] for i in samples) / token_cap))


def split_into(samples: Sequence[int], count: int, lengths: Sequence[int], costs: Sequence[float],
               token_cap: int, order: Sequence[int] | None = None) -> list[list[int]] | None:
    """Split ``samples`` into exactly ``count`` non-empty micro-batches under the cap, or None if this
    split breaks the cap. Micro-batches come heaviest first."""
    samples = list(samples)
    if count < 1 or count > len(samples):
        return None
    local_costs = [costs[i] for i in samples]
    local_order = None
    if order is not None:
        position = {item: p for p, item in enumerate(order)}
        local_order = sorted(range(len(samples)), key=lambda j: position[samples[j]])
    groups = karmarkar_karp(local_costs, count, order=local_order)
    batches = [[samples[j] for j in group] for group in groups]
    _fill_empty(batches, costs)
    if any(sum(lengths[i] for i in batch) > token_cap for batch in batches):
        return None
    return sort_heaviest_first(batches, costs)


def pack(samples: Sequence[int], lengths: Sequence[int], costs: Sequence[float], token_cap: int,
         order: Sequence[int] | None = None) -> list[list[int]]:
    """Fewest micro-batches that respect the cap (each rank on its own: LB-Mini)."""
    count = minimal_micro_batches(samples, lengths, token_cap)
    while count:
        batches = split_into(samples, count, lengths, costs, token_cap, order)
        if batches is not None:
            return batches
        count += 1
    return []


def sort_heaviest_first(batches: list[list[int]], costs: Sequence[float]) -> list[list[int]]:
    """Micro-batch i of every rank is then roughly the i-th heaviest, which is what aligning
    micro-batches across ranks (LB-Micro) relies on."""
    return sorted((sorted(batch) for batch in batches), key=lambda b: (-sum(costs[i] for i in b), b))


def _fill_empty(batches: list[list[int]], costs: Sequence[float]) -> None:
    """Karmarkar-Karp may leave a group empty when one item dwarfs the rest; give it the cheapest
    item of the fullest group so every micro-batch has a sample."""
    for batch in batches:
        if not batch:
            donor = max(batches, key=len)
            cheapest = min(donor, key=lambda i: costs[i])
            donor.remove(cheapest)
            batch.append(cheapest)
