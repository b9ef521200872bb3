"""How a Hugging Face Trainer runs LB-Mini slots (``zero_optimization.odc.balance``), bound on that Trainer.

With the balance block, the Trainer's training loader yields slots (:mod:`ds_odc.integration.hf_balance_loader`):
``gradient_accumulation_steps`` of them per rank per step, each holding zero or more of the rank's
planned micro-batches. Five of the Trainer's methods learn to handle a slot. They are bound on that
Trainer *instance* only (:func:`bind_balance`, called by :mod:`ds_odc.integration.hf_trainer` when the
Trainer's config has the block), and each delegates to the class's own method for the work of one batch
and for anything that is not a slot:

* ``get_train_dataloader``: the class's loader, rebuilt to yield slots;
* ``get_batch_samples``: a step's slots and its global number of loss tokens, counted over every rank's
  micro-batches (every rank joins the count, one with no micro-batch too); ordinary batches: the class's;
* ``training_step``: each micro-batch of the slot (the gradient-accumulation boundary on the slot's
  last one, ``engine.step()`` directly when this rank has no micro-batch left for the step);
* ``floating_point_ops``, ``_track_num_input_tokens``: over the slot's micro-batches.

Each slot's plan header is noted on the engine's step recorder (``ds_odc.metrics.note_plan``), so the figures
every ODC Trainer logs (its ``log``: :mod:`ds_odc.integration.hf_metrics`) compare the plan with what
ran, and add the keys this block has always logged (``odc_micro_batches``, ``odc_planned_utilisation``, ...).

What they share lives in one :class:`TrainerBalance` per Trainer (``balance_state(trainer)``). The collective
they add (the token count) goes through :func:`~ds_odc.integration.hf_gather.gather_rows`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools

import torch
from deepspeed.utils import logger

from ds_odc.balance.slots import BalancedSlot, StepHeader
from ds_odc.balance.split_plan import SPLIT_POLICY
from ds_odc.config import BalanceConfig
from ds_odc.errors import ODCConfigError
from ds_odc.integration.hf_balance_loader import slot_loader
from ds_odc.integration.hf_gather import gather_rows
from ds_odc.integration.hf_sequence_parallel import placement_of
from ds_odc.integration.patching import bind, swapped
from ds_odc.integration.surface import has
from ds_odc.integration.surface_table import TRAINER_RUN_EPOCH
from ds_odc.metrics import note_plan

#: The one attribute a bound Trainer carries besides its bound methods.
STATE_ATTRIBUTE = "_ds_odc_balance"
#: Trainer methods the slot behaviours call on the class, beyond the ones they replace.
CALLED = ("_get_num_items_in_batch",)
_END = object()


@dataclasses.dataclass
class TrainerBalance:
    """The balance behaviour of one Trainer and its state (see the module docstring).

    ``config``: the balance block. ``last_header``: the plan header of the last slot this rank ran (what the
    Trainer's ``log`` reports). ``warned_local_gather``: the warning about metrics gathered inside a micro-batch
    was given."""

    config: BalanceConfig
    last_header: StepHeader | None = None
    warned_local_gather: bool = False

    def behaviours(self, with_loader: bool) -> dict:
        """Method name -> ``behaviour(class's method, trainer, *args)`` (:func:`~ds_odc.integration.patching.bind`)."""
        methods = {"get_batch_samples": self.get_batch_samples, "training_step": self.training_step,
                   "floating_point_ops": self.floating_point_ops,
                   "_track_num_input_tokens": self.track_num_input_tokens}
        return {"get_train_dataloader": self.get_train_dataloader, **methods} if with_loader else methods

    # -- the five behaviours ---------------------------------------------------------------------------
    def get_train_dataloader(self, original, trainer):
        return slot_loader(trainer, original(trainer), self.config)

    def get_batch_samples(self, original, trainer, epoch_iterator, num_batches, device, *args, **kwargs):
        first = next(epoch_iterator, _END)
        if not isinstance(first, BalancedSlot):  # not a slot (or nothing left): the Trainer's own method
            rest = epoch_iterator if first is _END else itertools.chain([first], epoch_iterator)
            return original(trainer, rest, num_batches, device, *args, **kwargs)
        slots = [first, *itertools.islice(epoch_iterator, num_batches - 1)]
        micro_batches = [batch for slot in slots for batch in slot.micro_batches]
        with swapped(trainer.args, "average_tokens_across_devices", False):  # the count, without its gather
            count = trainer._get_num_items_in_batch(micro_batches, device)
        if trainer.args.average_tokens_across_devices and trainer.args.world_size > 1:
            # every rank joins, one with no micro-batch too (the Trainer's own gather skips an empty rank)
            local = torch.tensor([0.0 if count is None else float(count), 0.0 if count is None else 1.0])
            total = gather_rows(trainer, local, "loss-token count").sum(dim=0)
            count = total[0].to(device=device, dtype=torch.float32) if total[1] > 0 else None
        if count is None and self.config.policy == SPLIT_POLICY:  # the count is global: every rank alike
            raise ODCConfigError(f"zero_optimization.odc.balance.policy {SPLIT_POLICY!r}: the Trainer counted no "
                                 "loss tokens for this step (no 'labels' in the batches), so its loss would be a mean "
                                 "per micro-batch, which counts a split sample once per member: give every batch "
                                 "labels")
        return slots, count

    def training_step(self, original, trainer, model, inputs, num_items_in_batch=None, *args, **kwargs):
        if not isinstance(inputs, BalancedSlot):
            return original(trainer, model, inputs, num_items_in_batch, *args, **kwargs)
        gradient_state = trainer.accelerator.gradient_state
        sync = gradient_state.sync_gradients
        saved_accumulation = trainer.current_gradient_accumulation_steps
        # the Trainer divides a mean loss by this when the model reports no token counts: per rank, the
        # global micro-batch count over the world size, so the update is the mean over all micro-batches
        # (under sequence parallelism, over the SP groups: the ranks of a group run the same micro-batches)
        placement = placement_of(trainer)
        replicas = placement.groups if placement else trainer.args.world_size
        trainer.current_gradient_accumulation_steps = inputs.header.global_micro_batches / replicas
        self.last_header = inputs.header
        _note_plan(trainer, inputs.header)
        entries = inputs.entries or [None] * len(inputs.micro_batches)
        # with a count, the Trainer's loss is the micro-batch's token sum over the step's global count (times the
        # world size): it adds up over a split micro-batch's slices (checked at the first step, on every rank)
        token_sum = num_items_in_batch is not None
        total = torch.zeros((), device=trainer.args.device)
        try:
            with self.answered_locally(trainer):
                for m, (batch, entry) in enumerate(zip(inputs.micro_batches, entries)):
                    gradient_state._set_sync_gradients(sync and m == len(inputs.micro_batches) - 1)
                    with _planned_entry(trainer, entry, token_sum):
                        total = total + original(trainer, model, batch, num_items_in_batch, *args, **kwargs)
            if sync and not inputs.micro_batches:
                _step_without_micro_batch(trainer)
        finally:
            gradient_state._set_sync_gradients(sync)
            trainer.current_gradient_accumulation_steps = saved_accumulation
        return total

    def floating_point_ops(self, original, trainer, inputs):
        if isinstance(inputs, BalancedSlot):
            return sum(original(trainer, batch) for batch in inputs.micro_batches)
        return original(trainer, inputs)

    def track_num_input_tokens(self, original, trainer, inputs):
        if isinstance(inputs, BalancedSlot):
            for batch in inputs.micro_batches:
                original(trainer, batch)
            return None
        return original(trainer, inputs)

    # -- inside a micro-batch ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def answered_locally(self, trainer):
        """Inside a micro-batch, ``accelerator.gather`` / ``gather_for_metrics`` answer with this rank's value.

        Trainers gather metrics per micro-batch inside ``compute_loss`` (TRL's SFTTrainer: entropy, token
        accuracy, token counts). That is a collective per micro-batch: with different micro-batch counts
        per rank it would hang. The loss and the gradient norm are global regardless (reduced at the step
        and at logging); those per-micro-batch metrics become this rank's own, and a warning says so once.
        Only this Trainer's accelerator instance changes, for the duration of the slot."""
        if trainer.args.world_size == 1:
            yield
            return
        from accelerate.utils import recursively_apply

        def local(data, *args, **kwargs):
            if not self.warned_local_gather:
                self.warned_local_gather = True
                logger.warning("ds_odc balance: a metric gathered inside a micro-batch (e.g. TRL's entropy, "
                               "mean_token_accuracy, num_tokens) is this rank's own value: ranks run different "
                               "numbers of micro-batches, so a gather per micro-batch cannot be collective. The "
                               "logged loss and grad_norm are global.")
            return recursively_apply(lambda t: t.unsqueeze(0) if t.dim() == 0 else t, data)

        accelerator = trainer.accelerator
        with swapped(accelerator, "gather", local), swapped(accelerator, "gather_for_metrics", local):
            yield


def _planned_entry(trainer, entry, token_sum: bool):
    """Under the split policy, the entry's micro-batch runs inside ``engine.odc_micro_batch(entry)`` (a split one
    over its group: :mod:`ds_odc.integration.split_attention`), its loss declared a scaled token sum when the
    Trainer normalises by ``num_items_in_batch``; otherwise nothing changes."""
    if entry is None:
        return contextlib.nullcontext()
    return trainer.accelerator.deepspeed_engine_wrapped.engine.odc_micro_batch(entry, scaled_token_sum=token_sum)


def _step_without_micro_batch(trainer) -> None:
    """This rank has no micro-batch left in the step: take the step (every rank steps together)."""
    engine = trainer.accelerator.deepspeed_engine_wrapped.engine
    engine.set_gradient_accumulation_boundary(True)
    engine.step()


def _note_plan(trainer, header) -> None:
    """The step's plan, noted on the engine's recorder (the figures' ``ODC/plan/...``; a no-op without one)."""
    wrapped = trainer.accelerator.deepspeed_engine_wrapped
    if wrapped is not None:
        note_plan(wrapped.engine, header)


# -- binding ------------------------------------------------------------------------------------------------
def balance_state(trainer) -> TrainerBalance | None:
    """The balance state of a bound Trainer; None for any other."""
    return getattr(trainer, STATE_ATTRIBUTE, None)


def bind_balance(trainer, config: BalanceConfig, *, with_loader: bool = True, release: str | None = None
                 ) -> TrainerBalance:
    """Bind the slot behaviours on this ``trainer`` instance (idempotent); ``with_loader``: also rebuild its
    training loader. A method the Trainer's class lacks raises :class:`~ds_odc.errors.ODCConfigError`
    naming it and the transformers ``release``, and nothing is bound."""
    state = balance_state(trainer)
    if state is not None:
        return state
    if release is None:
        import transformers

        release = f"transformers {transformers.__version__}"
    if not has(TRAINER_RUN_EPOCH):  # the per-micro-batch methods the slots are bound through came in 5.3.0
        raise ODCConfigError(f"zero_optimization.odc.balance with the Hugging Face Trainer needs transformers>="
                             f"{TRAINER_RUN_EPOCH.release} ({TRAINER_RUN_EPOCH.newer}); found {release}: leave the "
                             "balance block out on this release (the odc stage itself works), or upgrade transformers")
    state = TrainerBalance(config)
    bind(trainer, state.behaviours(with_loader), also_needs=CALLED, needed_for="zero_optimization.odc.balance",
         release=release)
    setattr(trainer, STATE_ATTRIBUTE, state)
    return state


def balanced_loader(trainer, loader, config: BalanceConfig):
    """``loader`` (the Trainer's prepared training loader) rebuilt to yield planned slots, and ``trainer``
    taught to run them (its per-batch methods bound as for the balance block).

    What a Trainer with the balance block does by itself. Also callable from a Trainer subclass's
    ``get_train_dataloader`` on ZeRO-3 with ``"lb-micro"`` (every rank the same slots, so the collectives
    line up): the benchmark's baseline."""
    bind_balance(trainer, config, with_loader=False)
    return slot_loader(trainer, loader, config)
