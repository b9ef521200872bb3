"""Where the step recorder listens, on ZeRO-3 and ODC engines alike (instance attributes only: no
class is patched, so other engines in the process are untouched). The hooks are one
:class:`~ds_odc.integration.patching.PatchSet` per engine, undone by the engine's ``destroy()`` (its line in
``PROCESS_WIDE``, ``surface_table.py``); the recorder and its reports stay readable after it.

* ``engine.forward`` opens a micro-batch, ``engine.backward`` closes it (a torch-style
  ``loss.backward()`` micro-batch closes at the next forward or at the step);
* the parameter coordinator's ``fetch_sub_module`` is a *gather* (ZeRO-3: launch + wait of the
  all-gather; ODC: the pulls), the optimizer's ``__reduce_and_partition_ipg_grads`` a *reduce*
  (ZeRO-3: reduce-scatter; ODC: pushes);
* in the boundary ``engine.step()``: ``_overflow_check_and_loss_scale_update`` and
  ``_get_norm_groups`` (ZeRO-3's all-reduces) and every ODC rendezvous round (fence, norm, publish)
  are *step_wait*; ``_post_step`` (ZeRO-3's persistent-parameter all-gather) and ODC's persistent
  pulls are *gather*; the rest is optimizer time.
"""
from __future__ import annotations

import functools

from deepspeed.utils import logger

from ds_odc.integration.patching import PatchSet
from ds_odc.metrics.recorder import StepRecorder

_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


def attach_recorder(engine, log_interval: int = 0) -> StepRecorder:
    """Install the hooks on ``engine`` (a ``DeepSpeedEngine``) and return its recorder. Idempotent."""
    existing = getattr(engine, "odc_metrics", None)
    if isinstance(existing, StepRecorder):
        return existing
    on_step = None
    if log_interval:
        def on_step(report):
            if report.step % log_interval == 0:
                logger.info("odc metrics: %s", report.log_line())
    recorder = StepRecorder(rank=engine.global_rank, on_step=on_step, device=engine.device)
    hooks = PatchSet(f"the step recorder of rank {engine.global_rank}'s engine")
    hooks.replace(engine, "forward", lambda call: _before(recorder.begin_micro_batch, call))
    hooks.replace(engine, "backward", lambda call: _after(recorder.end_micro_batch, call))
    hooks.replace(engine, "step", lambda call: _boundary_step(engine, recorder, call))
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None:
        hooks.replace(offload.get_param_coordinator(), "fetch_sub_module",
                      lambda call: _spanned(recorder, "gather", call))
    for name, kind in ((_REDUCE, "reduce"), ("_overflow_check_and_loss_scale_update", "step_wait"),
                       ("_get_norm_groups", "step_wait"), ("_post_step", "gather"),
                       ("_pull_released_persistent_params", "gather")):
        if hasattr(optimizer, name):
            hooks.replace(optimizer, name, functools.partial(_spanned, recorder, kind))
    runtime = getattr(optimizer, "odc", None)
    if runtime is not None:
        hooks.replace(runtime.protocol, "round", lambda call: _spanned(recorder, "step_wait", call))
    hooks.replace(engine, "destroy", lambda destroy: _undoing(hooks, destroy))  # last: undone first
    engine.odc_metrics = recorder
    return recorder


def _undoing(hooks: PatchSet, destroy):
    """The engine's ``destroy()``, then every hook of the recorder undone (this one included)."""
    def wrapped(*args, **kwargs):
        try:
            return destroy(*args, **kwargs)
        finally:
            hooks.undo()
    return wrapped


def _before(hook, call):
    def wrapped(*args, **kwargs):
        hook()
        return call(*args, **kwargs)
    return wrapped


def _after(hook, call):
    def wrapped(*args, **kwargs):
        result = call(*args, **kwargs)
        hook()
        return result
    return wrapped


def _spanned(recorder, kind, call):
    def wrapped(*args, **kwargs):
        with recorder.span(kind):
            return call(*args, **kwargs)
    return wrapped


def _boundary_step(engine, recorder, call):
    def wrapped(*args, **kwargs):
        # an engine without managed_gradient_accumulation (DeepSpeed before surface_table.MANAGED_ACCUMULATION, and
        # not an ODC engine, which provides it) is managed: DeepSpeed ignores the key there
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        boundary = not managed or engine.is_gradient_accumulation_boundary()
        if not boundary:
            return call(*args, **kwargs)
        with recorder.optimizer_step():
            return call(*args, **kwargs)
    return wrapped
