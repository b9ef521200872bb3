"""The private ``DeepSpeedEngine`` methods the ODC engine overrides, kept apart from the public ones.

* ``_configure_zero_optimizer``: build :class:`ODCStage3Optimizer` where ZeRO-3 builds its
  optimizer. DeepSpeed imports the stage-3 class at call time from its module, so swapping that
  module attribute for the duration of the call picks ours with DeepSpeed's own ~45 arguments.
* ``_backward_prologue_per_tensor`` / ``_backward_post_hook``: the torch-style ``loss.backward()``
  path: no division by ``gradient_accumulation_steps`` for per-token micro-batches, and one ledger
  entry per backward.
* ``_take_model_step``: ``global_samples`` advances by the *global* number of micro-batches; the
  optimizer's ``zero_grad`` inside it is ZeRO-3's local one.
* ``_backward_epilogue``: marks DeepSpeed's own ``allreduce_gradients`` call inside backward, so that
  only a caller's explicit ``engine.allreduce_gradients()`` becomes a gradient fence.
"""
from __future__ import annotations

import contextlib
import functools

import deepspeed.runtime.superoffload.superoffload_stage3  # noqa: F401  (imports the stage-3 class itself)
import deepspeed.runtime.zero.stage3 as ds_stage3
from deepspeed.utils import logger

from ds_odc.config import MARKER_KEY, parse_options
from ds_odc.integration.zero3_optimizer import ODCStage3Optimizer
from ds_odc.runtime import MicroBatchLedger


@contextlib.contextmanager
def _stage3_class(factory):
    original = ds_stage3.DeepSpeedZeroOptimizer_Stage3
    ds_stage3.DeepSpeedZeroOptimizer_Stage3 = factory
    try:
        yield
    finally:
        ds_stage3.DeepSpeedZeroOptimizer_Stage3 = original


class ODCEngineHooks:
    """Mixin placed before ``DeepSpeedEngine`` in ``ODCEngine``'s bases."""

    def _configure_zero_optimizer(self, optimizer):
        self.odc_options = parse_options(self._config._param_dict.get(MARKER_KEY))
        self._odc_ledger = MicroBatchLedger()
        factory = functools.partial(ODCStage3Optimizer, odc_options=self.odc_options, odc_ledger=self._odc_ledger)
        with _stage3_class(factory):
            built = super()._configure_zero_optimizer(optimizer)
        if not isinstance(built, ODCStage3Optimizer):
            logger.warning("odc stage: engine without an optimizer (inference only); parameter gathers stay "
                           "ZeRO-3 collectives for this engine")
        return built

    def _backward_prologue_per_tensor(self, grad):
        # Inside engine.backward, which decided the rule (and consumed the pending token count) and
        # scaled the loss itself, DeepSpeed's prologue leaves the gradient alone.
        if grad is not None and not self._running_engine_backward and \
                self._odc_rule_for_backward(scale_wrt_gas=True, peek=True).skips_gas_division:
            return grad
        return super()._backward_prologue_per_tensor(grad)

    def _backward_post_hook(self):
        if not self._running_engine_backward and isinstance(self.optimizer, ODCStage3Optimizer):
            self._odc_record_backward(scale_wrt_gas=True)
        return super()._backward_post_hook()

    def _take_model_step(self, lr_kwargs):
        samples_before = self.global_samples
        optimizer = self.optimizer
        marked = isinstance(optimizer, ODCStage3Optimizer)
        if marked:
            optimizer.odc_inside_engine_step = True  # its zero_grad after the step is local
        try:
            super()._take_model_step(lr_kwargs)
        finally:
            if marked:
                optimizer.odc_inside_engine_step = False
        totals = self.optimizer.odc.last_totals
        if totals is not None:
            self.global_samples = samples_before + self.train_micro_batch_size_per_gpu() * totals.total_micro_batches

    def _backward_epilogue(self):
        self._odc_in_backward_epilogue = True
        try:
            return super()._backward_epilogue()
        finally:
            self._odc_in_backward_epilogue = False

    def allreduce_gradients(self, *args, **kwargs):
        """DeepSpeed's; called by the script itself (not by backward), it also fences gradients, so
        the optimizer's ``averaged_gradients`` hold every rank's micro-batches, as after ZeRO-3's."""
        result = super().allreduce_gradients(*args, **kwargs)
        optimizer = self.optimizer
        if not getattr(self, "_odc_in_backward_epilogue", False) and isinstance(optimizer, ODCStage3Optimizer):
            optimizer._odc_fence_for_read("engine.allreduce_gradients()")
        return result
