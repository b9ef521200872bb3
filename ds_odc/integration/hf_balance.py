"""The Hugging Face Trainer runs LB-Mini when the ds_config asks for it (``zero_optimization.odc.balance``).

The Trainer takes ``gradient_accumulation_steps`` batches per rank per optimizer step from a data
loader that accelerate shards: the underlying batch sampler (seeded, the same on every rank) yields
batches of ``per_device_train_batch_size`` samples and rank r gets batches r, r+W, r+2W, ... So the
samples of one optimizer step, over all ranks, are known to every rank without communication. With
the balance block the training data loader is rebuilt so that, for each step, every rank

1. replays accelerate's sharding of that epoch's batches for *every* rank (one pass of the seeded
   sampler, the same as the plain Trainer's, so the same samples per step),
2. plans the step's global minibatch with :mod:`ds_odc.balance` (same plan everywhere),
3. yields its own micro-batches as ``gradient_accumulation_steps`` slots (:mod:`ds_odc.balance.slots`),
   collated by the user's collator.

The Trainer's loop, step boundaries, epoch length, resume (which skips batches) and ``set_epoch`` are
untouched. Its per-batch methods learn to run a slot: ``training_step`` runs each micro-batch of the
slot (the gradient-accumulation boundary on the slot's last one, ``engine.step()`` directly when this
rank has no micro-batch left for the step), ``get_batch_samples`` counts the step's loss tokens over
all ranks (every rank joins the count, even one with no micro-batch), ``floating_point_ops`` and
``_track_num_input_tokens`` sum over the slot, and ``log`` adds the plan's per-rank micro-batch counts
and the measured utilisation to the Trainer's logs.

Patched names (``Trainer`` methods, checked in :mod:`ds_odc.integration.surface`): ``get_train_dataloader``,
``get_batch_samples``, ``training_step``, ``floating_point_ops``, ``_track_num_input_tokens``, ``log``; accelerate's
``DataLoaderShard`` is rebuilt the way ``accelerate.skip_first_batches`` rebuilds it.
"""
from __future__ import annotations

import contextlib
import functools

import torch
from deepspeed.utils import logger
from ds_odc_import_hooks import when_imported

from ds_odc.balance.cost import CostModel
from ds_odc.balance.slots import BalancedSlot, SlotCollator, SlotDataset, StepPlanner
from ds_odc.config import MARKER_KEY, BalanceConfig, QuadraticCost, parse_options
from ds_odc.errors import ODCConfigError, ODCError
from ds_odc.integration.hf_cost import measure_cost_model

PATCHED_MODULE = "transformers.trainer"
PATCHED_METHODS = ("get_train_dataloader", "get_batch_samples", "training_step", "floating_point_ops",
                   "_track_num_input_tokens", "log")
_originals: dict = {}


# -- which trainers balance ---------------------------------------------------------------------------
def balance_config(trainer) -> BalanceConfig | None:
    """The balance block of the trainer's ODC config, or None (no DeepSpeed, another stage, no block)."""
    hf_config = getattr(trainer.args, "hf_deepspeed_config", None)
    config = getattr(hf_config, "config", None)
    if not getattr(trainer, "is_deepspeed_enabled", False) or not isinstance(config, dict):
        return None
    options = config.get(MARKER_KEY)
    if not isinstance(options, dict) or options.get("balance") is None:
        return None
    return parse_options(options).balance


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

    def __init__(self, shard, *, world_size: int, rank: int, accumulation_steps: int, length_of, planner_for):
        self.shard = shard  # accelerate's BatchSamplerShard of this rank (or the plain batch sampler, one rank)
        self.world_size, self.rank, self.accumulation_steps = world_size, rank, accumulation_steps
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
            if hasattr(target, "set_epoch"):
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
            yield from planner.slots(self.epoch * 1_000_003 + step, members, lengths, stop - start)


# -- the Trainer patches --------------------------------------------------------------------------------
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
    by_length = {}
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


def balanced_loader(trainer, loader, config: BalanceConfig):
    """The Trainer's prepared training ``loader`` rebuilt to yield planned slots (see the module docstring).

    Used by ``get_train_dataloader`` when the config has a balance block. Also callable on ZeRO-3 with
    ``"lb-micro"`` (every rank the same slots, so the collectives line up): the benchmark's baseline."""
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

    def planner_for(members, lengths):
        if "planner" not in decided:
            padding = _decide_padding(config, dataset, collate_fn, members, length_of)
            cost_model = cost_model_of(config) or measure_cost_model(trainer, config)
            decided["planner"] = StepPlanner(world_size, rank, config.token_cap, config.policy, cost_model,
                                             padding, config.pad_to_multiple_of)
            if trainer.is_world_process_zero():
                logger.info(f"ds_odc balance: {config.policy}, token_cap {config.token_cap}, {padding} micro-batches, "
                            f"cost model {cost_model}")
        return decided["planner"]

    sampler = BalancedStepSampler(shard, world_size=world_size, rank=rank,
                                  accumulation_steps=trainer.args.gradient_accumulation_steps,
                                  length_of=length_of, planner_for=planner_for)
    ignored = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "collate_fn")
    kwargs = {k: getattr(loader, k, default) for k, default in _PYTORCH_DATALOADER_KWARGS.items() if k not in ignored}
    return DataLoaderShard(SlotDataset(dataset), device=loader.device, rng_types=loader.rng_types,
                           synchronized_generator=loader.synchronized_generator, iteration=loader.iteration,
                           batch_sampler=sampler, collate_fn=SlotCollator(collate_fn), **kwargs)


def _get_train_dataloader(original, self):
    loader = original(self)
    config = balance_config(self)
    if config is None:
        return loader
    return balanced_loader(self, loader, config)


@contextlib.contextmanager
def _per_rank_token_count(trainer):
    """The Trainer's own count of loss tokens, without its gather (done here, by every rank)."""
    saved = trainer.args.average_tokens_across_devices
    trainer.args.average_tokens_across_devices = False
    try:
        yield
    finally:
        trainer.args.average_tokens_across_devices = saved


def _get_batch_samples(original, self, epoch_iterator, num_batches, device):
    slots = []
    for _ in range(num_batches):
        try:
            slots.append(next(epoch_iterator))
        except StopIteration:
            break
    if not slots or not isinstance(slots[0], BalancedSlot):
        # not balanced: what the Trainer would have done with these batches
        count = self._get_num_items_in_batch(slots, device)
        return slots, count
    micro_batches = [batch for slot in slots for batch in slot.micro_batches]
    with _per_rank_token_count(self):
        count = self._get_num_items_in_batch(micro_batches, device)
    if self.args.average_tokens_across_devices and self.args.world_size > 1:
        # every rank joins, one with no micro-batch too (the Trainer's own gather skips an empty rank)
        local = torch.tensor([0.0 if count is None else float(count), 0.0 if count is None else 1.0], device=device)
        total = self.accelerator.gather(local.unsqueeze(0)).sum(dim=0)
        count = total[0] if total[1] > 0 else None
    return slots, count


def _training_step(original, self, model, inputs, num_items_in_batch=None, *args, **kwargs):
    if not isinstance(inputs, BalancedSlot):
        return original(self, model, inputs, num_items_in_batch, *args, **kwargs)
    gradient_state = self.accelerator.gradient_state
    sync = gradient_state.sync_gradients
    saved_accumulation = self.current_gradient_accumulation_steps
    # the Trainer divides a mean loss by this when the model reports no token counts: per rank, the
    # global micro-batch count over the world size, so the update is the mean over all micro-batches
    self.current_gradient_accumulation_steps = inputs.header.global_micro_batches / self.args.world_size
    self._odc_last_header = inputs.header
    total = torch.zeros((), device=self.args.device)
    try:
        with _gathers_answered_locally(self):
            for m, batch in enumerate(inputs.micro_batches):
                gradient_state._set_sync_gradients(sync and m == len(inputs.micro_batches) - 1)
                total = total + original(self, model, batch, num_items_in_batch, *args, **kwargs)
        if sync and not inputs.micro_batches:
            _step_without_micro_batch(self)
    finally:
        gradient_state._set_sync_gradients(sync)
        self.current_gradient_accumulation_steps = saved_accumulation
    return total


@contextlib.contextmanager
def _gathers_answered_locally(trainer):
    """Inside a micro-batch, ``accelerator.gather`` / ``gather_for_metrics`` answer with this rank's value.

    Trainers gather metrics per micro-batch inside ``compute_loss`` (TRL's SFTTrainer: entropy, token
    accuracy, token counts). That is a collective per micro-batch: with different micro-batch counts
    per rank it would hang. The loss and the gradient norm are global regardless (reduced at the step
    and at logging); those per-micro-batch metrics become this rank's own, and a warning says so once."""
    accelerator = trainer.accelerator
    if trainer.args.world_size == 1:
        yield
        return
    from accelerate.utils import recursively_apply

    def local(data, *args, **kwargs):
        if not getattr(trainer, "_odc_warned_local_gather", False):
            trainer._odc_warned_local_gather = True
            logger.warning("ds_odc balance: a metric gathered inside a micro-batch (e.g. TRL's entropy, "
                           "mean_token_accuracy, num_tokens) is this rank's own value: ranks run different "
                           "numbers of micro-batches, so a gather per micro-batch cannot be collective. The logged "
                           "loss and grad_norm are global.")
        return recursively_apply(lambda t: t.unsqueeze(0) if t.dim() == 0 else t, data)

    saved = {name: accelerator.__dict__.get(name) for name in ("gather", "gather_for_metrics")}
    accelerator.gather = accelerator.gather_for_metrics = local
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                accelerator.__dict__.pop(name, None)
            else:
                setattr(accelerator, name, value)


def _step_without_micro_batch(trainer) -> None:
    """This rank has no micro-batch left in the step: take the step (every rank steps together)."""
    engine = trainer.accelerator.deepspeed_engine_wrapped.engine
    engine.set_gradient_accumulation_boundary(True)
    engine.step()


def _floating_point_ops(original, self, inputs):
    if isinstance(inputs, BalancedSlot):
        return sum(original(self, batch) for batch in inputs.micro_batches)
    return original(self, inputs)


def _track_num_input_tokens(original, self, inputs):
    if isinstance(inputs, BalancedSlot):
        for batch in inputs.micro_batches:
            original(self, batch)
        return None
    return original(self, inputs)


# -- logs -----------------------------------------------------------------------------------------------
def _log(original, self, logs, *args, **kwargs):
    """At each training log (every rank logs at the same steps): each rank's micro-batch count in the
    last step and the utilisation the plan predicts (known everywhere, from the plan), and each rank's
    measured utilisation (``ds_odc.metrics``, one small gather)."""
    header = getattr(self, "_odc_last_header", None)
    if header is not None and "loss" in logs:
        logs = dict(logs)
        logs["odc_micro_batches"] = "/".join(str(c) for c in header.micro_batch_counts)
        logs["odc_planned_utilisation"] = round(header.planned_utilisation, 4)
        measured = _measured_utilisation(self)
        if measured is not None:
            logs["odc_utilisation"] = round(sum(measured) / len(measured), 4)
            logs["odc_utilisation_per_rank"] = "/".join(f"{u:.3f}" for u in measured)
    return original(self, logs, *args, **kwargs)


def _measured_utilisation(trainer):
    engine = getattr(trainer, "deepspeed", None)
    recorder = getattr(engine, "odc_metrics", None)
    report = getattr(recorder, "last", None) if recorder is not None else None
    available = torch.tensor([[0.0 if report is None else 1.0, 0.0 if report is None else report.utilisation]],
                             dtype=torch.float64, device=trainer.args.device)
    if trainer.args.world_size > 1:
        available = trainer.accelerator.gather(available)
    if not bool((available[:, 0] > 0).all()):
        return None
    return [float(u) for u in available[:, 1]]


# -- installing ----------------------------------------------------------------------------------------
_WRAPPERS = {"get_train_dataloader": _get_train_dataloader, "get_batch_samples": _get_batch_samples,
             "training_step": _training_step, "floating_point_ops": _floating_point_ops,
             "_track_num_input_tokens": _track_num_input_tokens, "log": _log}


def _patch(module) -> None:
    if _originals:
        return
    trainer_class = getattr(module, "Trainer", None)
    missing = [name for name in PATCHED_METHODS if not callable(getattr(trainer_class, name, None))]
    if missing:
        raise ImportError(f"{PATCHED_MODULE}.Trainer has no {', '.join(missing)}: this transformers release cannot "
                          "run zero_optimization.odc.balance")
    for name in PATCHED_METHODS:
        original = getattr(trainer_class, name)
        _originals[name] = original
        setattr(trainer_class, name, _bind(_WRAPPERS[name], original))


def _bind(wrapper, original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return wrapper(original, self, *args, **kwargs)

    return method


def register() -> None:
    """Patch the Trainer now if imported, else right after it is (idempotent)."""
    if not _originals:
        when_imported(PATCHED_MODULE, _patch)
