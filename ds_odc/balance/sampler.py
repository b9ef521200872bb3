"""Feeding a balanced plan to a torch ``DataLoader``.

:class:`BalancedBatchSampler` is a batch sampler: each item it yields is one micro-batch (a list of
dataset indices) of this rank, so ``DataLoader(dataset, batch_sampler=sampler, collate_fn=...)``
collates micro-batches as usual. Every rank shuffles the dataset the same way, cuts it into global
minibatches of ``samples_per_rank × world_size`` samples and plans each one; it then yields only its
own micro-batches. Steps have different numbers of micro-batches per rank under LB-Mini, so the
training loop asks the sampler where a step ends::

    sampler = BalancedBatchSampler(lengths, samples_per_rank=4, token_cap=2048)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
    for step_batches in sampler.group_steps(loader):     # one list of collated micro-batches per step
        for batch in step_batches:
            engine.backward(loss_sum(batch), loss_tokens=tokens(batch))
        engine.step()

(with ``"managed_gradient_accumulation": false``; in managed mode call
``engine.set_gradient_accumulation_boundary(i == len(step_batches) - 1)`` before each micro-batch).

Under Ulysses sequence parallelism pass ``sequence_parallel_size``: the plan is made per SP group (the
``world_size // sequence_parallel_size`` groups are its replicas, ``token_cap`` is per group), and every
rank of a group yields the same micro-batches of full sequences, each rank then taking its own slice of
each sequence (the ranks of one SP group must run the same micro-batches: :mod:`ds_odc.runtime.lockstep`).

Under the split policy (``policy="lb-mini-split"``, :func:`~ds_odc.balance.split.plan_split`) a long sample
may run over an aligned group of ranks: every member yields the whole packed micro-batch, and the loop runs
each entry of the rank's list inside ``engine.odc_micro_batch(entry)`` on its slice. :meth:`planned_steps`
gives each micro-batch with its entry (``MicroBatch``: ``ranks``, ``sequence``, ``part(rank)``)::

    sampler = BalancedBatchSampler(lengths, samples_per_rank=1, token_cap=65536, policy="lb-mini-split",
                                   engine=engine)
    for step_batches in sampler.planned_steps(loader):
        for entry, batch in step_batches:                 # split ones first, in the plan's order
            part = split_batch(batch, entry, rank)        # ds_odc.balance.split_batch
            with engine.odc_micro_batch(entry):
                loss, tokens = loss_sum(engine, part)     # over part["shift_labels"]
                engine.backward(loss, loss_tokens=tokens)
        engine.step()

The engine needs the same policy in its ds_config's balance block: it creates the groups at initialize and owns
where split micro-batches may run (``engine.odc_split_limits``: node size, group sizes, the largest group). Given
``engine=``, the sampler plans with those limits, read at its first iteration (a ``max_group`` or ``node_size``
passed as well must agree, or every rank refuses it there, by name). Without an engine (planning ahead of one),
pass both ``max_group`` and ``node_size``; the engine then refuses a micro-batch over a group it lacks.
"""
from __future__ import annotations

import random
from typing import Iterable, Iterator, Sequence

from torch.utils.data import Sampler

from ds_odc.balance.cost import CostModel
from ds_odc.balance.planner import POLICIES, Plan, plan_minibatch
from ds_odc.balance.split import plan_split
from ds_odc.balance.split_cost import AllToAllCost
from ds_odc.balance.split_limits import SplitLimits
from ds_odc.balance.split_plan import SPLIT_POLICY, MicroBatch, SplitPlan
from ds_odc.errors import ODCConfigError, ODCError


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches, step after step, for one epoch (call :meth:`set_epoch`).

    The split policy's own arguments (:func:`~ds_odc.balance.split.plan_split`): ``engine`` (the ODC engine with
    the policy, whose :class:`~ds_odc.balance.split_limits.SplitLimits` the plans use), or ``max_group`` (the most
    ranks a sample is split over, 2, 4 or 8) and ``node_size`` (ranks per node) without one; ``all_to_all``
    (Ulysses' cost, in the cost model's unit), ``min_chunk_tokens`` and ``min_gain``."""

    def __init__(self, lengths: Sequence[int], *, samples_per_rank: int, token_cap: int,
                 policy: str = "lb-mini", cost_model: CostModel | None = None, world_size: int | None = None,
                 rank: int | None = None, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 sequence_parallel_size: int = 1, max_group: int | None = None, node_size: int | None = None,
                 all_to_all: AllToAllCost | None = None, min_chunk_tokens: int = 2048, min_gain: float = 0.01,
                 engine=None):
        if policy not in (*POLICIES, SPLIT_POLICY):
            raise ODCError(f"unknown balancing policy {policy!r}; choose one of {', '.join((*POLICIES, SPLIT_POLICY))}")
        if samples_per_rank < 1:
            raise ODCError(f"samples_per_rank must be >= 1, got {samples_per_rank}")
        if policy == SPLIT_POLICY and sequence_parallel_size != 1:
            raise ODCError(f"BalancedBatchSampler: policy {SPLIT_POLICY!r} chooses its sequence-parallel groups "
                           f"per micro-batch; sequence_parallel_size={sequence_parallel_size} (fixed groups) cannot "
                           "go with it")
        if policy == SPLIT_POLICY and engine is None and (max_group is None or node_size is None):
            raise ODCError(f"BalancedBatchSampler: policy {SPLIT_POLICY!r} plans over the groups the engine created: "
                           "pass engine= (the ODC engine with the policy), or both max_group and node_size")
        world_size, rank = _world_and_rank(world_size, rank)
        world_size, rank = _sp_groups(world_size, rank, sequence_parallel_size)
        self.lengths = [int(s) for s in lengths]
        self.samples_per_rank, self.token_cap, self.policy = samples_per_rank, token_cap, policy
        self.cost_model = cost_model or CostModel.tokens()
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.all_to_all, self.max_group, self.node_size, self.engine = all_to_all, max_group, node_size, engine
        self.min_chunk_tokens, self.min_gain = min_chunk_tokens, min_gain
        self.epoch = 0
        self._plans: list[tuple[Plan | SplitPlan, list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._plans = epoch, None

    def plans(self) -> list[tuple[Plan | SplitPlan, list[int]]]:
        """Every step of the current epoch as (plan, dataset indices of the plan's samples); identical
        on every rank."""
        if self._plans is None:
            order = list(range(len(self.lengths)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            size = self.samples_per_rank * self.world_size
            cut = len(order) - len(order) % size if self.drop_last else len(order)
            limits = self.split_limits() if self.policy == SPLIT_POLICY else None
            self._plans = []
            for step, start in enumerate(range(0, cut, size)):
                members = order[start:start + size]
                lengths = [self.lengths[i] for i in members]
                plan: Plan | SplitPlan
                if limits is not None:
                    plan = plan_split(lengths, self.world_size, self.token_cap, self.cost_model, self.all_to_all,
                                      limits.node_size, limits.max_group, self.min_chunk_tokens, self.min_gain,
                                      seed=self.seed + step)
                else:
                    plan = plan_minibatch(lengths, self.world_size, self.token_cap, self.policy, self.cost_model,
                                          seed=self.seed + step)
                self._plans.append((plan, members))
        return self._plans

    def split_limits(self) -> SplitLimits:
        """Where the split policy's micro-batches may run: the engine's limits (checked against ``max_group`` and
        ``node_size`` when those were passed too), else those two as passed."""
        if self.engine is None:
            assert self.max_group is not None and self.node_size is not None  # __init__ requires them
            return SplitLimits(self.world_size, self.node_size, self.max_group)
        limits = getattr(self.engine, "odc_split_limits", None)
        if limits is None:
            raise ODCConfigError(f"BalancedBatchSampler(policy={SPLIT_POLICY!r}, engine=...): the engine has no split "
                                 f"policy; set zero_optimization.odc.balance.policy {SPLIT_POLICY!r} in its ds_config")
        limits.check_matches({"world_size": self.world_size, "max_group": self.max_group,
                              "node_size": self.node_size}, "BalancedBatchSampler")
        return limits

    def entries(self) -> list[list[MicroBatch]]:
        """This rank's list for every step: ``MicroBatch`` entries (samples as indices into the step's minibatch);
        a whole one runs alone (``ranks == (rank,)``), a split one over its group."""
        out = []
        for plan, _ in self.plans():
            if isinstance(plan, SplitPlan):
                out.append(plan.for_rank(self.rank))
            else:
                out.append([MicroBatch(tuple(batch), (self.rank,)) for batch in plan.micro_batches[self.rank]])
        return out

    def micro_batches_per_step(self) -> list[int]:
        return [len(mine) for mine in self.entries()]

    def __iter__(self) -> Iterator[list[int]]:
        for (_, members), mine in zip(self.plans(), self.entries()):
            for entry in mine:
                yield [members[i] for i in entry.samples]

    def __len__(self) -> int:
        return sum(self.micro_batches_per_step())

    def group_steps(self, loader: Iterable) -> Iterator[list]:
        """Group what ``loader`` yields (one element per micro-batch of this sampler) into steps."""
        if self.policy == SPLIT_POLICY:
            raise ODCError(f"BalancedBatchSampler: under {SPLIT_POLICY!r} a micro-batch may be split over ranks; "
                           "iterate planned_steps(loader), which gives each micro-batch with its entry")
        counts = iter(self.micro_batches_per_step())
        iterator = iter(loader)
        for count in counts:
            yield [next(iterator) for _ in range(count)]

    def planned_steps(self, loader: Iterable) -> Iterator[list[tuple[MicroBatch, object]]]:
        """Like :meth:`group_steps`, each micro-batch paired with its entry of this rank's list (any policy)."""
        iterator = iter(loader)
        for mine in self.entries():
            yield [(entry, next(iterator)) for entry in mine]


def _sp_groups(world_size: int, rank: int, sequence_parallel_size: int) -> tuple[int, int]:
    """(number of SP groups, this rank's group): the replicas a plan is made for under sequence parallelism."""
    if sequence_parallel_size < 1 or world_size % sequence_parallel_size:
        raise ODCError(f"BalancedBatchSampler: sequence_parallel_size={sequence_parallel_size} must be >= 1 and divide "
                       f"world_size {world_size}")
    return world_size // sequence_parallel_size, rank // sequence_parallel_size


def _world_and_rank(world_size, rank):
    if world_size is None or rank is None:
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ODCError("BalancedBatchSampler: pass world_size and rank, or initialise torch.distributed first")
        world_size = dist.get_world_size() if world_size is None else world_size
        rank = dist.get_rank() if rank is None else rank
    if not 0 <= rank < world_size:
        raise ODCError(f"BalancedBatchSampler: rank {rank} is outside world_size {world_size}")
    return world_size, rank
