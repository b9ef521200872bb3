"""The Trainer's training data loader, rebuilt to yield planned slots (``zero_optimization.odc.balance``).

The Trainer takes ``gradient_accumulation_steps`` batches per rank per optimizer step from a data
loader that accelerate shards: the underlying batch sampler (seeded, the same on every rank) yields
batches of ``per_device_train_batch_size`` samples and rank r gets batches r, r+W, r+2W, ... So the
samples of one optimizer step, over all ranks, are known to every rank without communication. The
rebuilt loader makes every rank, for each step,

1. replay accelerate's sharding of that epoch's batches for *every* rank (one pass of the seeded
   sampler, the same as the plain Trainer's, so the same samples per step),
2. plan the step's global minibatch with :mod:`ds_odc.balance` (same plan everywhere),
3. yield its own micro-batches as ``gradient_accumulation_steps`` slots (:mod:`ds_odc.balance.slots`),
   collated by the user's collator.

The Trainer's loop, step boundaries, epoch length, resume (which skips batches) and ``set_epoch`` are
untouched; how the Trainer runs a slot is :mod:`ds_odc.integration.hf_balance`. accelerate's
``DataLoaderShard`` is rebuilt the way ``accelerate.skip_first_batches`` rebuilds it. Nothing here
touches the Trainer beyond reading it.
"""
from __future__ import annotations

import functools

from deepspeed.utils import logger

from ds_odc.balance.cost import CostModel
from ds_odc.balance.slices import split_batch
from ds_odc.balance.slots import SlotCollator, SlotDataset, StepPlanner
from ds_odc.balance.split_plan import SPLIT_POLICY
from ds_odc.config import MARKER_KEY, BalanceConfig, QuadraticCost
from ds_odc.errors import ODCConfigError, ODCError
from ds_odc.integration.activation_offload import offload_aware_cost
from ds_odc.integration.hf_cost import measure_cost_model
from ds_odc.integration.hf_sequence_parallel import keep_planned_loader, placement_of, sharding_collator


# -- the cost model -------------------------------------------------------------------------------------
def cost_model_of(config: BalanceConfig) -> CostModel | None:
    """The configured cost model; None for "measure" (fitted once training starts)."""
    if config.cost_model == "tokens":
        return CostModel.tokens()
    if config.cost_model == "measure":
        return None
    model: QuadraticCost = config.cost_model
    base = CostModel.quadratic_linear(model.a, model.b, model.length_unit)
    return CostModel(base.quadratic, base.linear, model.per_micro_batch)


# -- the batch sampler --------------------------------------------------------------------------------
class _ReplayedBatches:
    """One epoch's batches of the underlying batch sampler, replayed to shard them for every rank."""

    def __init__(self, batches, batch_size, drop_last):
        self.batches, self.batch_size, self.drop_last = batches, batch_size, drop_last

    def __iter__(self):  # fresh lists: BatchSamplerShard extends the epoch's last batch in place
        return iter([list(batch) for batch in self.batches])

    def __len__(self):
        return len(self.batches)


class BalancedStepSampler:
    """Batch sampler of slots: for every optimizer step, the same global samples as accelerate's
    sharded sampler, planned, this rank's share cut into ``gradient_accumulation_steps`` slots."""

    def __init__(self, shard, *, world_size: int, rank: int, accumulation_steps: int, length_of, planner_for,
                 slots_per_round: int = 1):
        self.shard = shard  # accelerate's BatchSamplerShard of this rank (or the plain batch sampler, one rank)
        self.world_size, self.rank, self.accumulation_steps = world_size, rank, accumulation_steps
        self.slots_per_round = slots_per_round  # SP: a round of loader batches is sp_size of the Trainer's batches
        self.length_of, self.planner_for = length_of, planner_for
        self.sampler = self  # accelerate's set_epoch reaches a batch sampler's .sampler.set_epoch
        self.epoch = 0

    @property
    def _inner(self):
        return getattr(self.shard, "batch_sampler", self.shard) if self.world_size > 1 else self.shard

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        inner = self._inner
        for target in (inner, getattr(inner, "sampler", None)):
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.shard)

    def _rank_streams(self) -> list[list[list[int]]]:
        if self.world_size == 1:
            return [list(self.shard)]
        from accelerate.data_loader import BatchSamplerShard

        inner = self._inner
        replay = _ReplayedBatches(list(inner), getattr(inner, "batch_size", None), getattr(inner, "drop_last", False))
        streams = [list(BatchSamplerShard(replay, num_processes=self.world_size, process_index=rank,
                                          split_batches=self.shard.split_batches, even_batches=self.shard.even_batches))
                   for rank in range(self.world_size)]
        if len({len(s) for s in streams}) != 1:
            raise ODCError(f"balance: ranks would get different numbers of batches this epoch "
                           f"({[len(s) for s in streams]}); keep accelerate's even_batches on")
        return streams

    def __iter__(self):
        streams = self._rank_streams()
        rounds = len(streams[0])
        for step, start in enumerate(range(0, rounds, self.accumulation_steps)):
            stop = min(start + self.accumulation_steps, rounds)
            members = [i for r in range(start, stop) for stream in streams for i in stream[r]]
            lengths = [self.length_of(i) for i in members]
            planner = self.planner_for(members, lengths)
            yield from planner.slots(self.epoch * 1_000_003 + step, members, lengths,
                                     (stop - start) * self.slots_per_round)



# -- lengths and layout of the samples ---------------------------------------------------------------
def _sample_length(dataset, key: str):
    cache: dict[int, int] = {}

    def length_of(index: int) -> int:
        if index not in cache:
            item = dataset[index]
            try:
                cache[index] = len(item[key])
            except (KeyError, TypeError, IndexError):
                raise ODCError(f"balance: dataset item {index} has no sized field {key!r} to take its length from "
                               f"(set zero_optimization.odc.balance.length_key); item keys: "
                               f"{list(item) if hasattr(item, 'keys') else type(item).__name__}") from None
        return cache[index]

    return length_of


def _decide_padding(config: BalanceConfig, dataset, collate_fn, members, length_of) -> str:
    """"padded" or "packed": as configured, or from collating two samples of different lengths."""
    if config.padding != "auto":
        return config.padding
    by_length: dict = {}  # length -> the first member of that length
    for index in members:
        by_length.setdefault(length_of(index), index)
        if len(by_length) == 2:
            break
    if len(by_length) < 2:
        return "packed"  # every sample the same length: both layouts cost the same
    batch = collate_fn([dataset[i] for i in by_length.values()])
    ids = batch[config.length_key] if hasattr(batch, "keys") and config.length_key in batch else None
    shape = tuple(getattr(ids, "shape", ()))
    if len(shape) == 2 and shape[0] == 2:
        return "padded"
    if len(shape) == 2 and shape[0] == 1 or len(shape) == 1:
        return "packed"
    raise ODCConfigError(f"balance: cannot tell how the data collator lays out a micro-batch ({config.length_key} "
                         f"of two samples has shape {shape}); set zero_optimization.odc.balance.padding to "
                         '"padded" or "packed"')


# -- the loader ----------------------------------------------------------------------------------------
def slot_loader(trainer, loader, config: BalanceConfig):
    """The Trainer's prepared training ``loader`` rebuilt to yield planned slots (see the module docstring).
    On ZeRO-3 only ``"lb-micro"`` (every rank the same slots, so the collectives line up). Use it through
    :func:`ds_odc.integration.hf_balance.balanced_loader`, which also teaches the Trainer to run slots."""
    if MARKER_KEY not in trainer.args.hf_deepspeed_config.config and config.policy != "lb-micro":
        raise ODCConfigError(f"balance policy {config.policy!r} needs the odc stage: on ZeRO-3 every rank must run "
                             "the same number of micro-batches (\"lb-micro\")")
    from accelerate.data_loader import _PYTORCH_DATALOADER_KWARGS, BatchSamplerShard, DataLoaderShard

    world_size, rank = trainer.args.world_size, trainer.args.process_index
    shard = loader.batch_sampler
    if not isinstance(loader, DataLoaderShard) or (world_size > 1 and not isinstance(shard, BatchSamplerShard)):
        raise ODCConfigError("zero_optimization.odc.balance needs a map-style training dataset that accelerate "
                             "shards by batches (not an IterableDataset, dispatch_batches or split_batches)")
    dataset, collate_fn = loader.dataset, loader.collate_fn
    length_of = _sample_length(dataset, config.length_key)
    decided = {}
    # under sequence parallelism the plan's replicas are the SP groups (ds_odc.integration.hf_sequence_parallel)
    placement = placement_of(trainer)
    replicas, replica = (placement.groups, placement.group) if placement else (world_size, rank)
    accumulation_steps = trainer.args.gradient_accumulation_steps // (placement.size if placement else 1)

    split = config.policy == SPLIT_POLICY
    if split and placement is not None:
        raise ODCConfigError(f"zero_optimization.odc.balance.policy {SPLIT_POLICY!r} chooses its sequence-parallel "
                             "groups per micro-batch: leave accelerate's fixed sp_size (ParallelismConfig) out")

    def planner_for(members, lengths):
        if "planner" not in decided:
            padding = _decide_padding(config, dataset, collate_fn, members, length_of)
            if split and padding != "packed":
                raise ODCConfigError(f"zero_optimization.odc.balance.policy {SPLIT_POLICY!r} needs packed "
                                     f"micro-batches (the collator lays them out {padding!r}): a split micro-batch is "
                                     "one sequence cut over its ranks, so pack each micro-batch into one (e.g. "
                                     "transformers' DataCollatorWithFlattening) with per_device_train_batch_size=1")
            if placement is not None and padding != "packed":
                raise ODCConfigError("zero_optimization.odc.balance with sequence parallelism needs packed "
                                     "micro-batches "
                                     f"(the collator lays them out {padding!r}): Ulysses attention is built for "
                                     "micro-batches of per_device_train_batch_size sequences, so pack each micro-batch "
                                     "into one (e.g. transformers' DataCollatorWithFlattening) with "
                                     "per_device_train_batch_size=1")
            cost_model = cost_model_of(config) or measure_cost_model(trainer, config)
            cost_model = offload_aware_cost(trainer, cost_model, measured=config.cost_model == "measure")
            decided["planner"] = StepPlanner(replicas, replica, config.token_cap, config.policy, cost_model,
                                             padding, config.pad_to_multiple_of, **_split_options(trainer, config))
            if trainer.is_world_process_zero():
                logger.info(f"ds_odc balance: {config.policy}, token_cap {config.token_cap}, {padding} micro-batches, "
                            f"cost model {cost_model}")
        return decided["planner"]

    sampler = BalancedStepSampler(shard, world_size=world_size, rank=rank, accumulation_steps=accumulation_steps,
                                  length_of=length_of, planner_for=planner_for,
                                  slots_per_round=placement.size if placement else 1)
    if placement is not None:
        collate_fn = sharding_collator(collate_fn, placement)
        keep_planned_loader(trainer, lambda dl: getattr(dl, "batch_sampler", None) is sampler)
    split_collate = functools.partial(trainer_slice, rank=rank) if split else None
    ignored = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn")
    kwargs = {k: getattr(loader, k, default) for k, default in _PYTORCH_DATALOADER_KWARGS.items() if k not in ignored}
    return DataLoaderShard(SlotDataset(dataset), device=loader.device, rng_types=loader.rng_types,
                           synchronized_generator=loader.synchronized_generator, iteration=loader.iteration,
                           batch_sampler=sampler, collate_fn=SlotCollator(collate_fn, split_collate), **kwargs)


def _split_options(trainer, config: BalanceConfig) -> dict:
    """The split policy's planner arguments, at the first iteration (every rank plans every step, so every rank
    refuses alike): the engine's :class:`~ds_odc.balance.split_limits.SplitLimits` (the groups it created), and a
    loss that weighs a split sample as whole. The Trainer's loss is the micro-batch's token sum over the step's
    global count when it counts loss tokens (``num_items_in_batch``, which reaches the model's loss or
    ``compute_loss_func``, summed over every rank); otherwise each member's loss would be its slice's mean."""
    if config.policy != SPLIT_POLICY:
        return {}
    engine = getattr(getattr(trainer.accelerator, "deepspeed_engine_wrapped", None), "engine", None)
    limits = getattr(engine, "odc_split_limits", None)
    if limits is None:
        raise ODCConfigError(f"zero_optimization.odc.balance.policy {SPLIT_POLICY!r}: the Trainer's DeepSpeed engine "
                             "has no split groups (it must be the odc stage's training engine with this policy)")
    limits.check_matches({"world_size": trainer.args.world_size}, "the Trainer's world")
    if not (getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)):
        raise ODCConfigError(f"zero_optimization.odc.balance.policy {SPLIT_POLICY!r} with the Trainer needs a loss "
                             "normalised by the step's loss-token count (num_items_in_batch): the model's forward "
                             "does not take it (transformers' causal LMs do) and no compute_loss_func is given, so "
                             "each member of a split micro-batch would pass the mean over its slice")
    if trainer.args.world_size > 1 and not trainer.args.average_tokens_across_devices:
        raise ODCConfigError(f"zero_optimization.odc.balance.policy {SPLIT_POLICY!r} with the Trainer needs "
                             "average_tokens_across_devices=True: with each rank's own loss-token count, the members "
                             "of a split micro-batch would divide their slices by different counts")
    return {"split_limits": limits, "min_chunk_tokens": config.min_chunk_tokens}


def trainer_slice(batch: dict, entry, rank: int) -> dict:
    """A split micro-batch cut to this rank's slice (:func:`~ds_odc.balance.split_batch`),
    with ``labels`` kept as the slice's shifted labels, so that the Trainer counts its loss tokens (it counts
    ``shift_labels`` once ``labels`` is there) and the model's loss reads ``shift_labels``."""
    part = split_batch(batch, entry, rank)
    part["labels"] = part["shift_labels"]
    return part
