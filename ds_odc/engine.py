"""``ODCEngine``: a ``DeepSpeedEngine`` whose ZeRO-3 runs on one-sided pulls and pushes.

Returned by ``deepspeed.initialize`` for a config with ``"stage": "odc"``. Internally the stage is 3
(``engine.zero_optimization_stage() == 3``), so every ZeRO-3 path keeps working. What the engine
adds is the bookkeeping that lets ranks run *different* numbers of micro-batches per step:

* every backward records one micro-batch and the normalisation rule it asks for (see
  :mod:`ds_odc.runtime.ledger`); ``engine.backward(loss, loss_tokens=n)`` or
  ``engine.set_loss_tokens(n)`` selects per-token normalisation;
* the optimizer step divides the globally summed gradient once, by the global count (for the
  mean rule, DeepSpeed's per-micro-batch ``1 / gradient_accumulation_steps`` is kept and the step
  divides by ``global micro-batches / gradient_accumulation_steps``: the same mean, and with equal
  counts the same arithmetic as ZeRO-3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from deepspeed.runtime.engine import DeepSpeedEngine

from ds_odc.errors import ODCConfigError
from ds_odc.integration.checkpoints import ODCCheckpointHooks
from ds_odc.integration.engine_hooks import ODCEngineHooks
from ds_odc.runtime import Normalisation, Phase, StepTotals


@dataclass(frozen=True)
class _BackwardRule:
    rule: Normalisation
    tokens: int = 0

    @property
    def skips_gas_division(self) -> bool:
        """Per-token micro-batches are not divided by ``gradient_accumulation_steps``; the others keep
        DeepSpeed's division (MEAN corrects it at the step, CALLER is the caller's choice)."""
        return self.rule is Normalisation.TOKEN


class ODCEngine(ODCEngineHooks, ODCCheckpointHooks, DeepSpeedEngine):
    """See the module docstring. Build it with ``deepspeed.initialize``, not directly."""

    _odc_pending_tokens: Optional[int] = None
    odc_metrics = None
    """The :class:`~ds_odc.metrics.StepRecorder` of this rank (None with ``odc.metrics: false``)."""

    def __init__(self, *args, **kwargs):
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            # DeepSpeed configures the scheduler, checkpointing, ... after the ZeRO optimizer: a failure
            # there must not leave this process holding the windows it allocated (nor peers' mappings)
            optimizer = getattr(self, "optimizer", None)
            if getattr(optimizer, "odc", None) is not None:
                optimizer.destroy()
            raise
        options = getattr(self, "odc_options", None)
        if options is not None and options.metrics and hasattr(self.optimizer, "odc"):
            from ds_odc.integration.metrics_hooks import attach_recorder
            attach_recorder(self, options.metrics_log_interval)

    # -- normalisation bookkeeping -----------------------------------------------------------------
    def set_loss_tokens(self, loss_tokens: int) -> None:
        """Declare the number of loss tokens of the next backward's micro-batch (per-token
        normalisation; the loss passed to backward must then be the *sum* over those tokens)."""
        if int(loss_tokens) != loss_tokens or loss_tokens < 0:
            raise ValueError(f"loss_tokens must be a non-negative integer, got {loss_tokens!r}")
        self._odc_pending_tokens = int(loss_tokens)

    def _odc_rule_for_backward(self, scale_wrt_gas: bool, peek: bool = False) -> _BackwardRule:
        tokens = self._odc_pending_tokens
        if not peek:
            self._odc_pending_tokens = None
        if tokens is not None:
            return _BackwardRule(Normalisation.TOKEN, tokens)
        if self.odc_options.loss_normalization == "token":
            raise ODCConfigError("zero_optimization.odc.loss_normalization='token': this backward has no token "
                                 "count; call engine.backward(loss, loss_tokens=n) or engine.set_loss_tokens(n)")
        if self.managed_gradient_accumulation() and scale_wrt_gas:
            return _BackwardRule(Normalisation.MEAN)
        return _BackwardRule(Normalisation.CALLER)

    def _odc_record_backward(self, scale_wrt_gas: bool) -> None:
        """Ledger entry for a torch-style ``loss.backward()`` (engine.backward records its own)."""
        decided = self._odc_rule_for_backward(scale_wrt_gas)
        self.optimizer.odc.record_micro_batch(decided.rule, decided.tokens)

    # -- public API ------------------------------------------------------------------------------
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True, loss_tokens: Optional[int] = None):
        """``DeepSpeedEngine.backward`` plus an optional ``loss_tokens`` (per-token normalisation).

        A backward that fails before any gradient reached ZeRO-3's buckets may be retried; one that
        fails after has pushed, or would push again, part of its gradients: it fails the ODC group.
        Returns what DeepSpeed returns: the loss as scaled for accumulation."""
        if loss_tokens is not None:
            self.set_loss_tokens(loss_tokens)
        decided = self._odc_rule_for_backward(scale_wrt_gas)
        optimizer = self.optimizer
        seen = optimizer.odc_gradients_seen
        try:
            result = super().backward(loss, retain_graph=retain_graph,
                                      scale_wrt_gas=scale_wrt_gas and not decided.skips_gas_division)
        except BaseException as err:
            if optimizer.odc_gradients_seen != seen:
                optimizer.odc.fail(err, "backward (part of its gradients already reached the owners)")
            raise
        optimizer.odc.record_micro_batch(decided.rule, decided.tokens)
        return result

    def load_checkpoint(self, *args, **kwargs):
        result = super().load_checkpoint(*args, **kwargs)
        if hasattr(self.optimizer, "odc_republish"):
            self.optimizer.odc_republish()
        return result

    @property
    def odc_phase(self) -> Phase:
        """The step protocol's phase: IDLE, ACCUMULATING (gradients pushed since the last step), one
        of the step's phases, FAILED (the group failed: the engine refuses to continue) or CLOSED."""
        return self.optimizer.odc.phase

    @property
    def odc_last_step(self) -> Optional[StepTotals]:
        """Global micro-batch and token counts of the last optimizer step."""
        return self.optimizer.odc.last_totals
