"""A step's planned micro-batches, carried through a training loop that counts batches, not samples.

The Hugging Face Trainer (and loops like it) takes ``gradient_accumulation_steps`` batches from its
data loader per optimizer step, runs one forward+backward per batch and steps after the last one.
Under LB-Mini a rank runs its own number of micro-batches per step, zero included, so the loop's
count and the plan's cannot match. Instead of rewriting the loop, the plan is handed to it in
**slots**: the loader still yields ``gradient_accumulation_steps`` items per step, and each item (a
:class:`BalancedSlot`) holds zero or more of this rank's collated micro-batches. The loop's step
boundaries, epoch length, resume-by-skipping-batches and ``set_epoch`` therefore stay exactly as
they are; only the code that runs one batch learns to run a slot.

Slots travel through a torch ``DataLoader`` (and its worker processes) as ordinary batches of
indices: the batch sampler yields ``[header, (m, i), (m, j), ...]`` (``m`` the micro-batch within the
rank's plan, ``i`` a dataset index), :class:`SlotDataset` fetches the items, :class:`SlotCollator`
collates each micro-batch with the user's own collator. Under the split policy (``"lb-mini-split"``)
``m`` is ``(m, entry)``, the entry of the rank's list (``SplitPlan.for_rank``) the micro-batch runs as:
every member of a split micro-batch collates the whole packed micro-batch and then takes its slice
(the collator's ``split_collate``), and the slot carries the entries to the loop that runs them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ds_odc.balance.cost import CostModel
from ds_odc.balance.planner import Plan, plan_minibatch
from ds_odc.balance.split import plan_split
from ds_odc.balance.split_cost import AllToAllCost
from ds_odc.balance.split_limits import SplitLimits
from ds_odc.balance.split_plan import SPLIT_POLICY, MicroBatch, SplitPlan
from ds_odc.errors import ODCError


@dataclasses.dataclass(frozen=True)
class StepHeader:
    """What every rank knows about the step a slot belongs to (identical on every rank)."""

    step: int
    micro_batch_counts: tuple[int, ...]  # per rank
    rank_costs: tuple[float, ...]  # per rank, by the cost model
    samples: int  # in the global minibatch
    odc_cost: float = 0.0  # the plan's step cost when ranks meet only at the step (max_rank Σ_m)
    collective_cost: float = 0.0  # ... when they meet at every micro-batch (Σ_m max_rank)
    shared_micro_batches: int = 0  # split policy: entries in micro_batch_counts that another member also counts

    @property
    def global_micro_batches(self) -> int:
        """The step's micro-batches, each counted once: a split one, which every member of its group runs (and
        ``micro_batch_counts`` counts per member), is one micro-batch, as ``global_samples`` counts its samples
        once. The one rule the engine's step totals follow too (its members beyond the first are ``shared``)."""
        return sum(self.micro_batch_counts) - self.shared_micro_batches

    @property
    def planned_utilisation(self) -> float:
        """Mean over ranks of cost / busiest rank's cost: the balance the plan reaches by its cost model."""
        busiest = max(self.rank_costs, default=0.0)
        if busiest == 0:
            return 1.0
        return sum(self.rank_costs) / (len(self.rank_costs) * busiest)


@dataclasses.dataclass
class BalancedSlot:
    """Zero or more collated micro-batches of this rank, run where the loop runs one batch."""

    header: StepHeader
    micro_batches: list
    entries: list | None = None  # split policy: the MicroBatch each one runs as (split ones: this rank's slice)

    def to(self, device, non_blocking: bool = False) -> "BalancedSlot":
        """Device placement, as data loaders apply it to a batch (each micro-batch moved)."""
        from accelerate.utils import send_to_device

        return BalancedSlot(self.header, [send_to_device(b, device, non_blocking=non_blocking)
                                          for b in self.micro_batches], self.entries)


class SlotDataset:
    """The user's dataset, indexed by ``(micro_batch, index)``; a header item is passed through."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, item):
        if isinstance(item, StepHeader):
            return item
        micro_batch, index = item
        return micro_batch, self.dataset[index]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # e.g. column_names, set_epoch: the user's dataset answers
        if name == "dataset" or name.startswith("__"):  # never the user's __getitems__: items are ours
            raise AttributeError(name)
        return getattr(self.dataset, name)


class SlotCollator:
    """Collates each micro-batch of a slot with the user's collator; under the split policy, a split one is
    then cut to this rank's slice by ``split_collate(batch, entry)``."""

    def __init__(self, collate_fn: Callable[[list], Any],
                 split_collate: Callable[[Any, MicroBatch], Any] | None = None):
        self.collate_fn, self.split_collate = collate_fn, split_collate

    def __call__(self, items: list) -> BalancedSlot:
        header = items[0]
        groups: dict[Any, list] = {}
        for micro_batch, sample in items[1:]:
            groups.setdefault(micro_batch, []).append(sample)
        keys = sorted(groups, key=lambda key: key[0] if isinstance(key, tuple) else key)
        if not keys or not isinstance(keys[0], tuple):
            return BalancedSlot(header, [self.collate_fn(groups[key]) for key in keys])
        batches, entries = [], []
        for key in keys:
            entry, batch = key[1], self.collate_fn(groups[key])
            if entry.split and self.split_collate is not None:
                batch = self.split_collate(batch, entry)
            batches.append(batch)
            entries.append(entry)
        return BalancedSlot(header, batches, entries)


def slot_of_micro_batches(count: int, slots: int) -> list[int]:
    """Slot of each of ``count`` micro-batches among ``slots``: spread evenly, the last slot never
    empty while there is a micro-batch (the loop steps after its last slot, and a slot with a
    backward in it steps the usual way).

    >>> slot_of_micro_batches(1, 4), slot_of_micro_batches(5, 2), slot_of_micro_batches(3, 3)
    ([3], [0, 0, 1, 1, 1], [0, 1, 2])
    """
    return [slots - 1 - ((count - 1 - m) * slots) // count for m in range(count)]


@dataclasses.dataclass(frozen=True)
class StepPlanner:
    """Plans one step's global minibatch and cuts this rank's share into slots.

    ``padding``/``pad_to_multiple_of`` say how the collator lays a micro-batch out (``"packed"``:
    Σ lengths tokens; ``"padded"``: n × longest), so the cap and the costs are those of what runs.
    The split policy (packed only) also takes ``split_limits`` (the engine's groups,
    :class:`~ds_odc.balance.split_limits.SplitLimits`), ``min_chunk_tokens`` and ``all_to_all``
    (:func:`~ds_odc.balance.split.plan_split`).
    """

    world_size: int
    rank: int
    token_cap: int
    policy: str
    cost_model: CostModel
    padding: str = "packed"
    pad_to_multiple_of: int = 1
    split_limits: SplitLimits | None = None
    min_chunk_tokens: int = 2048
    all_to_all: AllToAllCost | None = None

    def __post_init__(self) -> None:
        if self.policy == SPLIT_POLICY and self.split_limits is None:
            raise ODCError(f"StepPlanner: policy {SPLIT_POLICY!r} needs split_limits (the engine's groups)")

    def plan(self, lengths: Sequence[int], seed: int) -> Plan | SplitPlan:
        if self.policy == SPLIT_POLICY:
            limits = self.split_limits
            assert limits is not None  # __post_init__
            return plan_split(lengths, self.world_size, self.token_cap, self.cost_model, self.all_to_all,
                              node_size=limits.node_size, max_group=limits.max_group,
                              min_chunk_tokens=self.min_chunk_tokens, seed=seed)
        return plan_minibatch(lengths, self.world_size, self.token_cap, self.policy, self.cost_model, seed=seed,
                              padding=self.padding, pad_to_multiple_of=self.pad_to_multiple_of)

    def slots(self, step: int, members: Sequence[int], lengths: Sequence[int], slots: int) -> list[list]:
        """``slots`` batch-sampler items of this rank for a step whose global minibatch is ``members``
        (dataset indices, ``lengths`` theirs): each ``[header, (m, index), ...]``."""
        plan = self.plan(lengths, seed=step)
        items: list[list]
        if isinstance(plan, SplitPlan):
            counts = tuple(len(plan.for_rank(r)) for r in range(plan.world_size))
            shared = sum(split.group_size - 1 for split in plan.splits)
            header = StepHeader(step, counts, tuple(plan.rank_costs()), len(members), plan.step_cost(),
                                plan.step_cost(), shared)
            entries = plan.for_rank(self.rank)
            items = [[header] for _ in range(slots)]
            for m, (entry, slot) in enumerate(zip(entries, slot_of_micro_batches(len(entries), slots))):
                items[slot].extend(((m, entry), members[i]) for i in entry.samples)
            return items
        header = StepHeader(step, tuple(plan.micro_batch_counts()), tuple(plan.rank_costs()), len(members),
                            plan.odc_step_cost(), plan.collective_step_cost())
        mine = plan.for_rank(self.rank)
        items = [[header] for _ in range(slots)]
        for m, (batch, slot) in enumerate(zip(mine, slot_of_micro_batches(len(mine), slots))):
            items[slot].extend((m, members[i]) for i in batch)
        return items
