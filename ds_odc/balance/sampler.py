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
"""
from __future__ import annotations

import random
from typing import Iterable, Iterator, Sequence

from torch.utils.data import Sampler

from ds_odc.balance.cost import CostModel
from ds_odc.balance.planner import POLICIES, Plan, plan_minibatch
from ds_odc.errors import ODCError


class BalancedBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches, step after step, for one epoch (call :meth:`set_epoch`)."""

    def __init__(self, lengths: Sequence[int], *, samples_per_rank: int, token_cap: int,
                 policy: str = "lb-mini", cost_model: CostModel | None = None, world_size: int | None = None,
                 rank: int | None = None, seed: int = 0, shuffle: bool = True, drop_last: bool = True,
                 sequence_parallel_size: int = 1):
        if policy not in POLICIES:
            raise ODCError(f"unknown balancing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if samples_per_rank < 1:
            raise ODCError(f"samples_per_rank must be >= 1, got {samples_per_rank}")
        world_size, rank = _world_and_rank(world_size, rank)
        world_size, rank = _sp_groups(world_size, rank, sequence_parallel_size)
        self.lengths = [int(s) for s in lengths]
        self.samples_per_rank, self.token_cap, self.policy = samples_per_rank, token_cap, policy
        self.cost_model = cost_model or CostModel.tokens()
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        self._plans: list[tuple[Plan, list[int]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._plans = epoch, None

    def plans(self) -> list[tuple[Plan, list[int]]]:
        """Every step of the current epoch as (plan, dataset indices of the plan's samples); identical
        on every rank."""
        if self._plans is None:
            order = list(range(len(self.lengths)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
            size = self.samples_per_rank * self.world_size
            cut = len(order) - len(order) % size if self.drop_last else len(order)
            self._plans = []
            for step, start in enumerate(range(0, cut, size)):
                members = order[start:start + size]
                plan = plan_minibatch([self.lengths[i] for i in members], self.world_size, self.token_cap,
                                      self.policy, self.cost_model, seed=self.seed + step)
                self._plans.append((plan, members))
        return self._plans

    def micro_batches_per_step(self) -> list[int]:
        return [len(plan.micro_batches[self.rank]) for plan, _ in self.plans()]

    def __iter__(self) -> Iterator[list[int]]:
        for plan, members in self.plans():
            for batch in plan.micro_batches[self.rank]:
                yield [members[i] for i in batch]

    def __len__(self) -> int:
        return sum(self.micro_batches_per_step())

    def group_steps(self, loader: Iterable) -> Iterator[list]:
        """Group what ``loader`` yields (one element per micro-batch of this sampler) into steps."""
        counts = iter(self.micro_batches_per_step())
        iterator = iter(loader)
        for count in counts:
            yield [next(iterator) for _ in range(count)]


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
