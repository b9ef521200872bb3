"""Where the step recorder listens, on ZeRO-3 and ODC engines alike (instance attributes only: no
class is patched, so other engines in the process are untouched). The hooks are one
:class:`~ds_odc.integration.patching.PatchSet` per engine, undone by the engine's ``destroy()`` (its line in
``PROCESS_WIDE``, ``surface_process_wide.py``); the recorder and its reports stay readable after it.

* ``engine.forward`` opens a micro-batch, ``engine.backward`` closes it (a torch-style
  ``loss.backward()`` micro-batch closes at the next forward or at the step);
* the parameter coordinator's ``fetch_sub_module`` is a *gather* (ZeRO-3: launch + wait of the
  all-gather; ODC: the pulls), the optimizer's ``__reduce_and_partition_ipg_grads`` a *reduce*
  (ZeRO-3: reduce-scatter; ODC: pushes);
* in the boundary ``engine.step()``: ``_overflow_check_and_loss_scale_update`` and
  ``_get_norm_groups`` (ZeRO-3's all-reduces) and every ODC rendezvous round (fence, norm, publish)
  are *step_wait*; ``_post_step`` (ZeRO-3's persistent-parameter all-gather) and ODC's persistent
  pulls are *gather*; the rest is optimizer time.

Counted as well (``StepReport.counters``): the tokens each forward receives (``input_ids``, else the first
tensor argument: :func:`~ds_odc.integration.activation_offload.tokens_of`); on ODC the bytes of every pull
(``pull_many`` / ``pull`` of the runtime) and push (the gradient handed to its ``push``: what ZeRO-3's
reduce-scatters take, also under ``deterministic``, whose two fp64 parts per value the runtime cuts afterwards),
the cross-node exchange inside the step (the link's ``reduce_gradients`` / ``gather_windows``, on several nodes),
the split micro-batches (``engine.odc_micro_batch`` of a split entry, timed) and the bytes activation offload
moved; and every rank's micro-batch count from the fence. After the step, the
:class:`~ds_odc.integration.metrics_publish.Publisher` writes the monitor's figures and the timeline.
"""
from __future__ import annotations

import contextlib
import functools

from deepspeed.utils import logger

from ds_odc.integration.activation_offload import tokens_of
from ds_odc.integration.metrics_publish import Publisher, job_fields
from ds_odc.integration.patching import PatchSet
from ds_odc.metrics.recorder import StepRecorder

_REDUCE = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"


#: Fields that are counters of the step (registered at 0 every step, so a rank without the work counts 0).
_COUNTED = ("tokens", "pull_bytes", "push_bytes", "cross_node_s", "split_micro_batches", "split_s", "offload_bytes")


def attach_recorder(engine, log_interval: int = 0) -> StepRecorder:
    """Install the hooks on ``engine`` (a ``DeepSpeedEngine``) and return its recorder. Idempotent. An ODC engine's
    ``odc.timeline`` option is written from here too."""
    existing = getattr(engine, "odc_metrics", None)
    if isinstance(existing, StepRecorder):
        return existing
    on_step = None
    if log_interval:
        def on_step(report):
            if report.step % log_interval == 0:
                logger.info("odc metrics: %s", report.log_line())
    recorder = StepRecorder(rank=engine.global_rank, on_step=on_step, device=engine.device)
    timeline = getattr(getattr(engine, "odc_options", None), "timeline", None)  # the odc stage's option
    publisher = Publisher(engine, recorder, log_interval, timeline)
    counted = [name for name in job_fields(engine) if name in _COUNTED]
    hooks = PatchSet(f"the step recorder of rank {engine.global_rank}'s engine")
    hooks.replace(engine, "forward", lambda call: _forward(recorder, call))
    hooks.replace(engine, "backward", lambda call: _after(recorder.end_micro_batch, call))
    hooks.replace(engine, "step", lambda call: _boundary_step(engine, recorder, publisher, counted, call))
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
        _count_odc_work(engine, runtime, recorder, hooks, counted)
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


def _count_odc_work(engine, runtime, recorder, hooks: PatchSet, counted) -> None:
    """The ODC counters (module docstring): bytes pulled and pushed, the cross-node exchange, split micro-batches."""
    hooks.replace(runtime, "pull_many", lambda call: _counting(recorder, "pull_bytes", lambda keys, outs: outs, call))
    hooks.replace(runtime, "pull", lambda call: _counting(recorder, "pull_bytes", lambda key, out: [out], call))
    hooks.replace(runtime, "push", lambda call: _counting(recorder, "push_bytes", lambda key, grad: [grad], call))
    if "cross_node_s" in counted:
        for name in ("reduce_gradients", "gather_windows"):
            hooks.replace(runtime.link, name, functools.partial(_measured, recorder, "cross_node"))
    if "split_s" in counted:
        hooks.replace(engine, "odc_micro_batch", lambda call: _split_micro_batch(recorder, call))


def _counting(recorder, name, tensors_of, call):
    """``call``, adding the bytes of the tensors ``tensors_of(*args)`` picks to the counter ``name``."""
    def wrapped(*args, **kwargs):
        recorder.count(name, sum(t.numel() * t.element_size() for t in tensors_of(*args, **kwargs)))
        return call(*args, **kwargs)
    return wrapped


def _measured(recorder, kind, call):
    def wrapped(*args, **kwargs):
        with recorder.measure(kind):
            return call(*args, **kwargs)
    return wrapped


def _split_micro_batch(recorder, call):
    """``engine.odc_micro_batch(entry)``: a split entry (over several ranks) is counted and timed."""
    @contextlib.contextmanager
    def wrapped(entry, *args, **kwargs):
        if len(tuple(entry.ranks)) < 2:
            with call(entry, *args, **kwargs):
                yield
            return
        recorder.count("split_micro_batches", 1)
        with recorder.measure("split"), call(entry, *args, **kwargs):
            yield
    return wrapped


def _forward(recorder, call):
    """``engine.forward``: opens a micro-batch and counts its tokens."""
    def wrapped(*args, **kwargs):
        recorder.begin_micro_batch()
        recorder.count("tokens", tokens_of(args, kwargs) or 0)
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


def _boundary_step(engine, recorder, publisher, counted, call):
    offloaded = _Offloaded(engine)

    def wrapped(*args, **kwargs):
        # an engine without managed_gradient_accumulation (DeepSpeed before surface_table.MANAGED_ACCUMULATION, and
        # not an ODC engine, which provides it) is managed: DeepSpeed ignores the key there
        managed = getattr(engine, "managed_gradient_accumulation", lambda: True)()
        boundary = not managed or engine.is_gradient_accumulation_boundary()
        if not boundary:
            return call(*args, **kwargs)
        with recorder.optimizer_step():
            result = call(*args, **kwargs)
            for name in counted:  # a rank without the work counts 0 (its figure is not left out)
                recorder.count(name, 0)
            totals = _fence_totals(engine)
            if totals is not None:
                recorder.note_micro_batches(totals.per_rank_micro_batches)
            if "offload_bytes" in counted:
                recorder.count("offload_bytes", offloaded.since_last())
        if publisher.active:  # the step returned on every rank: the figures' exchange ([Note: the figures' exchange])
            publisher.after_step()
        return result
    return wrapped


def _fence_totals(engine):
    runtime = getattr(engine.optimizer, "odc", None)
    return getattr(runtime, "last_totals", None)


class _Offloaded:
    """Bytes activation offload moved to the host since the last call (its per-micro-batch ``history``)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.seen: object = None  # the newest history entry counted

    def since_last(self) -> int:
        offload = getattr(self.engine, "odc_activation_offload", None)
        if offload is None or not offload.history:
            return 0
        new = []
        for stats in reversed(offload.history):
            if stats is self.seen:
                break
            new.append(stats.moved_bytes)
        self.seen = offload.history[-1]
        return sum(new)
