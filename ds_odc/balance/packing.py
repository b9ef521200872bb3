"""Pack one rank's samples into micro-batches under a token cap.

The fewest micro-batches is best (each costs a fixed overhead and, under ZeRO-3, a round of
collectives), so packing starts at ``ceil(tokens / cap)`` micro-batches, splits the samples between
them with Karmarkar-Karp on cost, and adds one micro-batch at a time until every one respects the
cap. One sample per micro-batch always fits (a sample longer than the cap is an error), so the loop
ends.

>>> pack([0, 1, 2, 3], lengths=[5, 4, 3, 2], costs=[5, 4, 3, 2], token_cap=7)
[[0, 3], [1, 2]]

That prices a micro-batch as *packed* samples (a flattening collator: tokens = Σ lengths). A padding
collator (HF ``DataCollatorWithPadding``) pads every sample of a micro-batch to its longest one, so n
samples of longest length L make ``n·L`` tokens and cost n times an L-long sample. Then the best
micro-batches hold samples of similar length: :func:`pack_padded` sorts by length and cuts runs.

>>> pack_padded([0, 1, 2, 3], lengths=[5, 4, 3, 2], token_cap=9)
[[0], [1, 2], [3]]
>>> micro_batch_tokens([4, 3], "padded"), micro_batch_tokens([4, 3], "padded", pad_to_multiple_of=8)
(8, 16)

The planner balances ranks the same way for both collators; what differs is kept here, in one
:class:`Packer` per collator (:class:`PackedPacker`, :class:`PaddedPacker`): how one rank's share is
packed, how ranks are brought to the same micro-batch count, and what a micro-batch costs.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol, Sequence

from ds_odc.arguments import require_whole_number
from ds_odc.balance.cost import CostModel
from ds_odc.balance.partition import karmarkar_karp
from ds_odc.errors import ODCError

PADDINGS = ("packed", "padded")


def check_padding(padding: str, pad_to_multiple_of: int) -> None:
    """Refuse a pricing that no collator produces, before any plan is priced with it. Rounding only
    exists for padding collators, so a multiple other than 1 with packed samples is a mistake."""
    if padding not in PADDINGS:
        raise ODCError(f"unknown padding {padding!r}; choose one of {', '.join(PADDINGS)}")
    require_whole_number("pad_to_multiple_of", pad_to_multiple_of, 1)
    if padding == "packed" and pad_to_multiple_of != 1:
        raise ODCError(f"pad_to_multiple_of={pad_to_multiple_of} needs padding='padded': packed samples are not padded")


def check_samples(lengths: Sequence[int], token_cap: int) -> None:
    """A cap and samples a plan can be made of at all: at least 1 token each. How long a sample may be
    depends on the policy: :func:`check_lengths` for whole samples; under the split policy up to the
    largest group × the cap (:func:`~ds_odc.balance.split_plan.smallest_groups`)."""
    if token_cap < 1:
        raise ODCError(f"token_cap must be >= 1, got {token_cap}")
    for index, length in enumerate(lengths):
        if length < 1:
            raise ODCError(f"sample {index} has length {length}; every sample needs at least 1 token")


def check_lengths(lengths: Sequence[int], token_cap: int, pad_to_multiple_of: int = 1) -> None:
    """Every sample must fit a micro-batch on its own, after the collator rounds it up (every policy that
    runs samples whole; the split policy allows longer ones: :func:`check_samples`)."""
    check_samples(lengths, token_cap)
    for index, length in enumerate(lengths):
        if length > token_cap:
            raise ODCError(f"sample {index} has {length} tokens, more than token_cap={token_cap}: "
                           "raise the cap or truncate the sample")
        rounded = padded_length(length, pad_to_multiple_of)
        if rounded > token_cap:
            raise ODCError(f"sample {index} has {length} tokens, {rounded} once padded to a multiple of "
                           f"{pad_to_multiple_of}, more than token_cap={token_cap}: raise the cap, lower "
                           "pad_to_multiple_of or truncate the sample")


def padded_length(length: int, pad_to_multiple_of: int = 1) -> int:
    """``length`` rounded up to the multiple, as the collator pads it (tensor-core friendly shapes)."""
    return -(-length // pad_to_multiple_of) * pad_to_multiple_of


def micro_batch_tokens(batch_lengths: Sequence[int], padding: str = "packed", pad_to_multiple_of: int = 1) -> int:
    """Tokens the collator produces for one micro-batch: ``Σ s`` packed, ``n·L`` padded (L the longest,
    rounded up). This is what the token cap bounds: it is what occupies activation memory."""
    if padding == "packed":
        return sum(batch_lengths)
    return len(batch_lengths) * padded_length(max(batch_lengths, default=0), pad_to_multiple_of)


def micro_batch_cost(batch_lengths: Sequence[int], model: CostModel, padding: str = "packed",
                     pad_to_multiple_of: int = 1) -> float:
    """``per_micro_batch + Σ sample_cost(s)`` packed; padded, every sample runs as an L-long row (the
    padding is computed, then masked), so ``per_micro_batch + n·sample_cost(L)``."""
    if padding == "packed":
        return model.micro_batch_cost(batch_lengths)
    longest = padded_length(max(batch_lengths, default=0), pad_to_multiple_of)
    return model.per_micro_batch + len(batch_lengths) * model.sample_cost(longest)


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


def sort_heaviest_first_by(batches: list[list[int]], cost) -> list[list[int]]:
    """Micro-batch i of every rank is then roughly the i-th heaviest by ``cost(batch)``, which is
    what aligning micro-batches across ranks (LB-Micro) relies on. Each lists its samples by index;
    equal costs go by those lists."""
    return sorted((sorted(batch) for batch in batches), key=lambda b: (-cost(b), b))


def sort_heaviest_first(batches: list[list[int]], costs: Sequence[float]) -> list[list[int]]:
    """:func:`sort_heaviest_first_by` the sum of the samples' ``costs`` (packed pricing, less the
    fixed cost every micro-batch shares)."""
    return sort_heaviest_first_by(batches, lambda batch: sum(costs[i] for i in batch))


def by_length(samples: Sequence[int], lengths: Sequence[int], order: Sequence[int] | None = None) -> list[int]:
    """Longest first; equal lengths in ``order`` (the planner's seeded shuffle), else by index."""
    position = {item: p for p, item in enumerate(order)} if order is not None else {}
    return sorted(samples, key=lambda i: (-lengths[i], position.get(i, i)))


def pack_padded(samples: Sequence[int], lengths: Sequence[int], token_cap: int, order: Sequence[int] | None = None,
                pad_to_multiple_of: int = 1) -> list[list[int]]:
    """Fewest padded micro-batches under the cap ``n·L <= cap``, as consecutive runs of the samples
    sorted longest first (micro-batches in that order; each lists its samples longest first).

    Why runs of sorted lengths: a micro-batch pays for its longest sample n times, so grouping
    similar lengths wastes the least padding. Why greedy: the run starting at the longest remaining
    sample may hold ``cap // L`` samples whatever else it holds, and filling it with the next-longest
    ones only makes the rest shorter, so cutting a run exactly when the next sample would break the
    cap gives the fewest micro-batches (an exchange argument). Every sample fits alone
    (:func:`check_lengths`), so every run is non-empty."""
    batches: list[list[int]] = []
    limit = 0  # samples the current run may hold: cap // (its first, longest, rounded length)
    for i in by_length(samples, lengths, order):
        if not batches or len(batches[-1]) >= limit:
            batches.append([])
            limit = token_cap // padded_length(lengths[i], pad_to_multiple_of)
        batches[-1].append(i)
    return batches


def split_largest_run(batches: list[list[int]]) -> None:
    """Add one micro-batch by cutting the one with the most samples (the first such) into two runs:
    its longest half and the rest, in place. Both parts keep ``n·L <= cap`` (fewer samples, no
    longer ones) and stay runs of similar lengths. Needs a micro-batch with at least 2 samples."""
    index = max(range(len(batches)), key=lambda m: (len(batches[m]), -m))
    batch = batches[index]
    assert len(batch) >= 2, "no micro-batch left to split: fewer samples than micro-batches asked for"
    half = len(batch) // 2
    batches[index:index + 1] = [batch[:half], batch[half:]]


class Packer(Protocol):
    """What LB-Mini and LB-Micro need to know about the collator; the balancing itself is the same.

    ``pack(share)``: one rank's fewest micro-batches under the cap, heaviest first (LB-Mini).
    ``same_count(shares)``: every rank's micro-batches under the cap, all ranks with the same count,
    as few as the packer finds room for on every rank (a rank with fewer samples than that stops at
    one sample per micro-batch), heaviest first (LB-Micro). ``price(batch)``: the cost model's cost
    of one micro-batch as the collator builds it, fixed cost included (what a plan is judged by).
    """

    def pack(self, share: Sequence[int]) -> list[list[int]]: ...

    def same_count(self, shares: Sequence[Sequence[int]]) -> list[list[list[int]]]: ...

    def price(self, batch: Sequence[int]) -> float: ...


@dataclasses.dataclass(frozen=True)
class PackedPacker:
    """A flattening collator (``Σ s`` tokens): Karmarkar-Karp on cost, from ``ceil(tokens / cap)``
    micro-batches up (:func:`pack`, :func:`split_into`).

    >>> packer = PackedPacker([6, 5, 3, 3], costs=[6, 5, 3, 3], token_cap=8, order=None, model=CostModel.tokens())
    >>> packer.pack([2, 3]), packer.same_count([[0, 1], [2, 3]])  # rank 0 needs 2, so rank 1 splits too
    ([[2, 3]], [[[0], [1]], [[2], [3]]])
    """

    lengths: Sequence[int]
    costs: Sequence[float]
    token_cap: int
    order: Sequence[int] | None
    model: CostModel

    def price(self, batch: Sequence[int]) -> float:
        return micro_batch_cost([self.lengths[i] for i in batch], self.model)

    def pack(self, share: Sequence[int]) -> list[list[int]]:
        return pack(share, self.lengths, self.costs, self.token_cap, self.order)

    def same_count(self, shares: Sequence[Sequence[int]]) -> list[list[list[int]]]:
        """Start at the count the most loaded rank needs at least; when any rank's split breaks the
        cap at that count, every rank moves to one more together, as the counts must agree."""
        count = max(minimal_micro_batches(share, self.lengths, self.token_cap) for share in shares)
        while True:
            # a rank with no sample (fewer samples than ranks) has no micro-batch: it must not block the loop
            attempt = [split_into(share, min(count, len(share)), self.lengths, self.costs, self.token_cap,
                                  self.order) if share else [] for share in shares]
            complete = [batches for batches in attempt if batches is not None]
            if len(complete) == len(attempt):
                return complete
            count += 1


@dataclasses.dataclass(frozen=True)
class PaddedPacker:
    """A padding collator (``n·L`` tokens): runs of similar lengths (:func:`pack_padded`), priced
    padded, so mixing a long sample with short ones costs what it costs.

    >>> packer = PaddedPacker([8, 7, 2, 2], token_cap=14, order=None, model=CostModel.tokens())
    >>> packer.pack([0, 1, 2, 3])  # [1, 2] costs 2 x 7: the heaviest
    [[1, 2], [0], [3]]
    >>> packer.same_count([[0, 1], [2, 3]])  # rank 0 needs 2 runs, so rank 1 splits its one
    [[[0], [1]], [[2], [3]]]
    """

    lengths: Sequence[int]
    token_cap: int
    order: Sequence[int] | None
    model: CostModel
    pad_to_multiple_of: int = 1

    def price(self, batch: Sequence[int]) -> float:
        return micro_batch_cost([self.lengths[i] for i in batch], self.model, "padded", self.pad_to_multiple_of)

    def pack(self, share: Sequence[int]) -> list[list[int]]:
        return sort_heaviest_first_by(self._runs(share), self.price)

    def same_count(self, shares: Sequence[Sequence[int]]) -> list[list[list[int]]]:
        """Each rank's fewest runs, then ranks with fewer micro-batches split their fullest one until
        every rank has as many as the rank that needs most (that many is the fewest common count,
        and splitting a run never breaks the cap)."""
        ranks = [self._runs(share) for share in shares]
        count = max((len(batches) for batches in ranks), default=0)
        for share, batches in zip(shares, ranks):
            while len(batches) < min(count, len(share)):
                split_largest_run(batches)  # on the runs as packed: each still lists its longest first
        return [sort_heaviest_first_by(batches, self.price) for batches in ranks]

    def _runs(self, share: Sequence[int]) -> list[list[int]]:
        return pack_padded(share, self.lengths, self.token_cap, self.order, self.pad_to_multiple_of)


def packer_for(padding: str, lengths: Sequence[int], costs: Sequence[float], token_cap: int,
               order: Sequence[int] | None, model: CostModel, pad_to_multiple_of: int = 1) -> Packer:
    """The packer of the collator ``padding`` names (``costs``: the per-sample costs the planner balances)."""
    if padding == "packed":
        return PackedPacker(lengths, costs, token_cap, order, model)
    return PaddedPacker(lengths, token_cap, order, model, pad_to_multiple_of)


def _fill_empty(batches: list[list[int]], costs: Sequence[float]) -> None:
    """Karmarkar-Karp may leave a group empty when one item dwarfs the rest; give it the cheapest
    item of the fullest group so every micro-batch has a sample."""
    for batch in batches:
        if not batch:
            donor = max(batches, key=len)
            cheapest = min(donor, key=lambda i: costs[i])
            donor.remove(cheapest)
            batch.append(cheapest)

