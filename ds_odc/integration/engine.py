"""``ODCEngine``: a ``DeepSpeedEngine`` whose ZeRO-3 runs on one-sided pulls and pushes.

Returned by ``deepspeed.initialize`` for a config with ``"stage": "odc"``. Internally the stage is 3
(``engine.zero_optimization_stage() == 3``), so every ZeRO-3 path keeps working. What the engine adds
is the bookkeeping that lets ranks run *different* numbers of micro-batches per step:

* every backward records one micro-batch and the normalisation rule it asks for (see
  :mod:`ds_odc.runtime.ledger`); ``engine.backward(loss, loss_tokens=n)`` or
  ``engine.set_loss_tokens(n)`` selects per-token normalisation;
* the optimizer step divides the globally summed gradient once, by the global count (for the mean
  rule, DeepSpeed's per-micro-batch ``1 / gradient_accumulation_steps`` is kept and the step divides
  by ``global micro-batches / gradient_accumulation_steps``).

One class; each override of a private ``DeepSpeedEngine`` method is a few lines that hand the work to
``ds_odc.integration`` (the optimizer, checkpoints, metrics, the backward's rule in :mod:`.backward_rules`, the
forward's lockstep in :mod:`.engine_locksteps`), and every private name it relies on is listed in
:mod:`ds_odc.integration.surface`:

* ``_configure_zero_optimizer`` builds :class:`~ds_odc.integration.zero3_optimizer.ODCStage3Optimizer`
  where ZeRO-3 builds its optimizer (DeepSpeed imports the class at call time from its module, so
  swapping that module attribute for the call picks ours with DeepSpeed's own ~45 arguments);
* ``_backward_prologue_per_tensor`` / ``_backward_post_hook``: the torch-style ``loss.backward()``
  path: no division by ``gradient_accumulation_steps`` for per-token micro-batches, one ledger entry;
* ``_take_model_step``: runs inside the optimizer's step context (its ``zero_grad`` after the step is
  local), and ``global_samples`` advances by the *global* number of micro-batches;
* ``_backward_epilogue``: marks DeepSpeed's own ``allreduce_gradients`` call, so that only a caller's
  explicit one is a fence;
* ``managed_gradient_accumulation`` / ``is_gradient_accumulation_boundary``: on DeepSpeed releases without
  ``"managed_gradient_accumulation": false`` (``surface_table.MANAGED_ACCUMULATION``), the engine provides it:
  the key is read from the ds_config, and then every ``step()`` is the boundary.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Optional

import deepspeed.runtime.superoffload.superoffload_stage3  # noqa: F401  (imports the stage-3 class itself)
import deepspeed.runtime.zero.stage3 as ds_stage3
import torch
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.utils import logger

from ds_odc.balance.split_limits import SplitLimits
from ds_odc.config import ENV_SWITCH, MARKER_KEY, ODCConfig, env_switch, parse_options
from ds_odc.errors import ODCConfigError, ODCStateError
from ds_odc.integration import (
    backward_rules,
    checkpoints,
    clean_exit,
    engine_locksteps,
    hf_generation,
    sequence_parallel,
    split_attention,
    zero3_frozen,
)
from ds_odc.integration.accumulation import UnmanagedAccumulation
from ds_odc.integration.activation_offload import EngineOffload
from ds_odc.integration.backward_rules import BackwardRule
from ds_odc.integration.patching import swapped
from ds_odc.integration.timeouts import resolve_timeout_s
from ds_odc.integration.zero3_optimizer import ODCStage3Optimizer
from ds_odc.runtime import ODCRuntime, Phase, StepTotals
from ds_odc.runtime.lockstep import SequenceParallelLockstep


@dataclass
class _EngineState:
    """Everything the ODC engine keeps besides DeepSpeed's own state (one attribute, ``_odc``)."""

    options: ODCConfig
    pending_tokens: Optional[int] = None  # set_loss_tokens() before the next backward
    in_backward_epilogue: bool = False  # DeepSpeed's own allreduce_gradients call is not a fence
    frozen: Optional[zero3_frozen.FrozenSession] = None  # an engine without an optimizer: its pulls
    lockstep: Optional[SequenceParallelLockstep] = None  # Ulysses SP: the ranks of a group run the same forwards
    split: Optional[split_attention.SplitRuntime] = None  # "lb-mini-split": groups, attention hook, lockstep
    activations: Optional[EngineOffload] = None  # odc.activation_offload: the forward's saved-tensor hooks


class ODCEngine(UnmanagedAccumulation, DeepSpeedEngine):
    """See the module docstring. Build it with ``deepspeed.initialize``, not directly."""

    _odc: Optional[_EngineState] = None
    odc_metrics = None
    """The :class:`~ds_odc.metrics.StepRecorder` of this rank (None with ``odc.metrics: false``)."""

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            # DeepSpeed configures the scheduler, checkpointing, ... after the ZeRO optimizer: a failure
            # there must not leave this process holding the windows it allocated (nor peers' mappings)
            if isinstance(getattr(self, "optimizer", None), ODCStage3Optimizer):
                self.optimizer.destroy()
            if self._odc is not None and self._odc.frozen is not None:
                self._odc.frozen.release()
            if self._odc is not None:
                engine_locksteps.detach(self._odc.lockstep, self._odc.split)
            raise
        if self._odc is not None and self._odc.options.metrics and self.odc_trains:
            from ds_odc.integration.metrics_hooks import attach_recorder
            attach_recorder(self, self._odc.options.metrics_log_interval)
        if self._odc is not None:  # each rank decodes at its own pace (:mod:`ds_odc.integration.hf_generation`)
            hf_generation.bind(self.module, lambda: isinstance(self._odc_lockstep(), SequenceParallelLockstep))

    @property
    def _odc_state(self) -> _EngineState:
        """``_odc``, which ``_configure_zero_optimizer`` sets while DeepSpeed builds the engine."""
        if self._odc is None:
            raise ODCStateError("this engine has no ODC state: DeepSpeed did not configure its ZeRO optimizer")
        return self._odc

    @property
    def odc_trains(self) -> bool:
        """Whether this engine trains on ODC (an engine without an optimizer is inference-only: frozen)."""
        return isinstance(self.optimizer, ODCStage3Optimizer)

    @property
    def odc_runtime(self) -> Optional[ODCRuntime]:
        """This engine's ODC runtime: its transport, layout and step protocol (a frozen engine's only pulls)."""
        if self.odc_trains:
            return self.optimizer.odc
        return self._odc.frozen.runtime if self._odc is not None and self._odc.frozen is not None else None

    def destroy(self):
        """DeepSpeed's; a frozen engine's parameters then go back to ZeRO-3's gathers and its session closes
        (a training engine's optimizer releases its own)."""
        try:
            super().destroy()
        finally:
            hf_generation.unbind(getattr(self, "module", None))
            if self._odc is not None:
                engine_locksteps.detach(self._odc.lockstep, self._odc.split)
                self._odc.lockstep = self._odc.split = None
                frozen, self._odc.frozen = self._odc.frozen, None
                if frozen is not None:
                    frozen.release()

    # -- public API ------------------------------------------------------------------------------
    @property
    def odc_options(self) -> Optional[ODCConfig]:
        """The parsed ``zero_optimization.odc`` options."""
        return self._odc.options if self._odc is not None else None

    def set_loss_tokens(self, loss_tokens: int) -> None:
        """Declare the number of loss tokens of the next backward's micro-batch (per-token
        normalisation; the loss passed to backward must then be the *sum* over those tokens)."""
        if int(loss_tokens) != loss_tokens or loss_tokens < 0:
            raise ValueError(f"loss_tokens must be a non-negative integer, got {loss_tokens!r}")
        self._odc_state.pending_tokens = int(loss_tokens)

    @property
    def odc_split_limits(self) -> Optional[SplitLimits]:
        """Where this engine's split micro-batches may run (balance policy "lb-mini-split"; None otherwise): the
        groups it created at initialize. Plan with these (``BalancedBatchSampler(..., engine=engine)`` reads them)."""
        split = self._odc.split if self._odc is not None else None
        return split.limits if split is not None else None

    @property
    def odc_activation_offload(self) -> Optional[EngineOffload]:
        """The activation offload of this engine (its profile, pool and per-micro-batch ``history``), or None."""
        return self._odc.activations if self._odc is not None else None

    def odc_plan_activation_offload(self, tokens: int) -> None:
        """The next training forward's token count, as a planner counted it (else it is read from the inputs)."""
        if self.odc_activation_offload is not None:
            self.odc_activation_offload.plan_next(tokens)

    @contextlib.contextmanager
    def odc_micro_batch(self, micro_batch, scaled_token_sum: bool = False):
        """Run one entry of this rank's list for the step (``SplitPlan.for_rank(rank)``, policy "lb-mini-split";
        :mod:`ds_odc.integration.split_attention`): its forward(s) and backward go inside. A split entry runs
        with Ulysses attention over its group, behind the split lockstep (its members begin each forward
        together: :mod:`ds_odc.runtime.split_lockstep`); a whole one as usual. Feed it this rank's slice
        (:func:`~ds_odc.balance.split_batch`), and pass the slice's loss sum and token count
        to ``backward(loss, loss_tokens=...)``.

        Inside a split micro-batch each member holds a slice of its samples, so only a loss that adds up over the
        slices weighs a split sample as it weighs whole: the per-token rule (``loss_tokens``), or a loss of the
        caller's that is the slice's token sum times a factor every member shares (``scaled_token_sum=True``: e.g.
        divided by the step's global token count, as the HF Trainer's ``num_items_in_batch`` loss is). A mean (the
        mean rule, or a mean the caller passes with ``scale_wrt_gas=False`` or ``gradient_accumulation_steps`` 1)
        is refused by name before anything is pushed, on every backward route."""
        split = self._odc_state.split
        if split is None:
            if len(micro_batch.ranks) > 1:
                raise ODCConfigError("a split micro-batch needs zero_optimization.odc.balance.policy 'lb-mini-split' "
                                     "in the ds_config (the engine creates its groups at initialize)")
            yield
            return
        with split.micro_batch(micro_batch, scaled_token_sum):
            yield

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True, loss_tokens: Optional[int] = None):
        """``DeepSpeedEngine.backward`` plus an optional ``loss_tokens`` (per-token normalisation).

        A backward that fails before any gradient reached ZeRO-3's buckets may be retried; one that
        fails after has pushed, or would push again, part of its gradients: it fails the ODC group.
        Returns what DeepSpeed returns: the loss as scaled for accumulation."""
        if loss_tokens is not None:
            self.set_loss_tokens(loss_tokens)
        decided = self._odc_rule_for_backward(scale_wrt_gas)
        split = self._odc_state.split
        if split is not None:
            split.check_backward(decided.rule, "engine.backward()")
        optimizer = self.optimizer
        seen = optimizer.odc_gradients_seen
        offload = self._odc_state.activations
        try:
            if offload is not None:
                offload.before_backward()
            with self._odc_collectives("backward"):
                result = super().backward(loss, retain_graph=retain_graph,
                                          scale_wrt_gas=scale_wrt_gas and not decided.skips_gas_division)
        except BaseException as err:
            if optimizer.odc_gradients_seen != seen:
                optimizer.odc.fail(err, "backward (part of its gradients already reached the owners)")
            raise
        if offload is not None:
            offload.after_backward(retain_graph)
        optimizer.odc.record_micro_batch(decided.rule, decided.tokens, shared=self._odc_shares_the_micro_batch())
        return result

    def _odc_shares_the_micro_batch(self) -> bool:
        split = self._odc_state.split
        return split is not None and split.shares_micro_batch()

    def forward(self, *inputs, **kwargs):
        """DeepSpeed's; under Ulysses sequence parallelism first the SP lockstep (:mod:`ds_odc.runtime.lockstep`:
        the ranks of one SP group run the same micro-batches), and under the micro-batch's activation-offload
        hooks when ``odc.activation_offload`` is set."""
        engine_locksteps.before_forward(self._odc_lockstep(), self._odc.split if self._odc is not None else None,
                                        self.module, kwargs, self.module.training)
        offload = self.odc_activation_offload
        with self._odc_collectives("forward"):
            if offload is None:
                return super().forward(*inputs, **kwargs)
            with offload.forward(lambda: self.module(*inputs, **kwargs), inputs, kwargs, self.module.training):
                return super().forward(*inputs, **kwargs)

    def _odc_lockstep(self) -> Optional[sequence_parallel.Lockstep]:
        """A training engine's own lockstep (fixed SP's, or the split micro-batches'); a frozen engine takes the
        newest training engine's."""
        if self._odc is None:
            return None
        return engine_locksteps.lockstep_of(self._odc.frozen is not None, self._odc.lockstep, self._odc.split)

    def _odc_collectives(self, where: str):
        lockstep = self._odc_lockstep()
        return lockstep.collectives(where) if lockstep is not None else contextlib.nullcontext()

    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        """DeepSpeed's (the optimizer moves the windows with every rank, see ``ODCStage3Optimizer``). A frozen
        engine, whose states ZeRO-3 refuses to move, moves the one it has: its parameter window (``lp_params``),
        with every rank (collective); the engine refuses to pull until :meth:`reload_states`."""
        frozen = self._odc.frozen if self._odc is not None else None
        if frozen is None:
            return super().offload_states(include=include, device=device, pin_memory=pin_memory,
                                          non_blocking=non_blocking)
        return frozen.offload_states(self, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False):
        """DeepSpeed's; a frozen engine brings its parameter window back (collective)."""
        frozen = self._odc.frozen if self._odc is not None else None
        if frozen is None:
            return super().reload_states(non_blocking=non_blocking)
        frozen.reload(non_blocking)
        return True

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's, with a crash-safe ``latest`` (:mod:`ds_odc.integration.checkpoints`)."""
        return checkpoints.save_checkpoint(self, super().save_checkpoint, save_dir, tag, client_state, save_latest,
                                           exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, *args, **kwargs):
        """DeepSpeed's, checked against this job's world size, completed after a universal load, and
        re-published to every rank (:mod:`ds_odc.integration.checkpoints`)."""
        return checkpoints.load_checkpoint(self, super().load_checkpoint, load_dir, tag, *args, **kwargs)

    def odc_exchange(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's ``values`` (1-D, at most :data:`~ds_odc.runtime.core.VALUES_WIDTH`), one float64 row
        per rank, between steps. Collective: every rank calls it at the same point (as a ``gather``), but it
        is an ODC round, so a rank that died or stalls is named within ``timeout_s`` instead of leaving its
        peers in a collective until the process group's timeout. ``what`` names it in errors."""
        return self.optimizer.odc.exchange_values(values, what)

    @property
    def odc_phase(self) -> Phase:
        """The step protocol's phase: IDLE, ACCUMULATING (gradients pushed since the last step), one
        of the step's phases, FAILED (the group failed: the engine refuses to continue) or CLOSED."""
        return self._odc_runtime_or_raise().phase

    @property
    def odc_last_step(self) -> Optional[StepTotals]:
        """Global micro-batch and token counts of the last optimizer step."""
        return self._odc_runtime_or_raise().last_totals

    def _odc_runtime_or_raise(self) -> ODCRuntime:
        runtime = self.odc_runtime
        if runtime is None:
            raise ODCStateError("this engine has no ODC runtime: an engine without an optimizer closes its session "
                                "at destroy()")
        return runtime

    # -- normalisation bookkeeping -----------------------------------------------------------------
    def _odc_rule_for_backward(self, scale_wrt_gas: bool, peek: bool = False) -> BackwardRule:
        """The rule of the backward about to run (:func:`~ds_odc.integration.backward_rules.decide`); consumes
        a token count from :meth:`set_loss_tokens` unless ``peek``."""
        state = self._odc_state
        tokens = state.pending_tokens
        if not peek:
            state.pending_tokens = None
        return backward_rules.decide(tokens, state.options.loss_normalization, self.managed_gradient_accumulation(),
                                     scale_wrt_gas, self.gradient_accumulation_steps())

    # -- DeepSpeedEngine's private methods, overridden ----------------------------------------------
    def _configure_zero_optimizer(self, optimizer):
        self._odc = _EngineState(parse_options(self._config._param_dict.get(MARKER_KEY)))
        if self._odc.options.activation_offload is not None:
            self._odc.activations = EngineOffload(self._odc.options.activation_offload, self.module, self.device)
        if env_switch() is not None:
            logger.info(f"ds_odc: {ENV_SWITCH}=odc runs this stage-3 engine on the odc stage, with options "
                        f"{self._config._param_dict.get(MARKER_KEY)}")
        clean_exit.install_teardown_notice()  # tearing the group down with this engine open: peers learn at once
        factory = functools.partial(ODCStage3Optimizer, odc_options=self._odc.options)
        with swapped(ds_stage3, "DeepSpeedZeroOptimizer_Stage3", factory):
            built = super()._configure_zero_optimizer(optimizer)
        timeout_s = resolve_timeout_s(self._odc.options.timeout_s)
        if not isinstance(built, ODCStage3Optimizer):  # no optimizer: a frozen model, which only pulls
            self._odc.frozen = zero3_frozen.attach(built, self._odc.options, timeout_s)
            logger.info("odc stage: engine without an optimizer (frozen); its parameters are pulled one-sided")
        else:
            self._odc.lockstep, self._odc.split = engine_locksteps.attach(self, built, self._odc.options.balance,
                                                                          timeout_s)
        return built

    def _backward_prologue_per_tensor(self, grad):
        # Inside engine.backward, which decided the rule (and consumed the pending token count) and
        # scaled the loss itself, DeepSpeed's prologue leaves the gradient alone.
        if self._running_engine_backward:
            return super()._backward_prologue_per_tensor(grad)
        rule = self._odc_rule_for_backward(scale_wrt_gas=True, peek=True)
        split = self._odc.split if self._odc is not None else None
        if split is not None:  # a torch-style loss.backward(): checked before any gradient reaches a bucket
            split.check_backward(rule.rule, "loss.backward()")
        if grad is not None and rule.skips_gas_division:
            return grad
        return super()._backward_prologue_per_tensor(grad)

    def _backward_post_hook(self):
        if not self._running_engine_backward and self.odc_trains:  # a torch-style loss.backward()
            decided = self._odc_rule_for_backward(scale_wrt_gas=True)
            self.optimizer.odc.record_micro_batch(decided.rule, decided.tokens,
                                                  shared=self._odc_shares_the_micro_batch())
            activations = self._odc_state.activations
            if activations is not None:
                activations.after_backward()
        return super()._backward_post_hook()

    def _take_model_step(self, lr_kwargs):
        if not self.odc_trains:
            return super()._take_model_step(lr_kwargs)
        samples_before = self.global_samples
        activations = self._odc_state.activations
        if activations is not None:
            activations.at_step()
        with self.optimizer.step_context() as step:
            super()._take_model_step(lr_kwargs)
        if step.totals is not None:  # the ranks of an SP group, or a split micro-batch's members: count it once
            totals = step.totals
            micro_batches = ((totals.total_micro_batches - totals.shared_micro_batches)
                             // sequence_parallel.sequence_parallel_size(self))
            self.global_samples = samples_before + self.train_micro_batch_size_per_gpu() * micro_batches

    def _backward_epilogue(self):
        state = self._odc_state
        state.in_backward_epilogue = True
        try:
            return super()._backward_epilogue()
        finally:
            state.in_backward_epilogue = False

    def allreduce_gradients(self, *args, **kwargs):
        """DeepSpeed's; called by the script itself (not by backward), it also fences gradients, so
        the optimizer's ``averaged_gradients`` hold every rank's micro-batches, as after ZeRO-3's."""
        result = super().allreduce_gradients(*args, **kwargs)
        if not self._odc_state.in_backward_epilogue and self.odc_trains:
            self.optimizer._odc_fence_for_read("engine.allreduce_gradients()")
        return result
