"""ZeRO-3 parameter gathers become one-sided pulls.

ZeRO-3's coordinator (hooks, prefetch, release) is kept as it is. What changes:

* each parameter's ``all_gather_coalesced`` / ``all_gather`` closures, the only ways the coordinator,
  ``GatheredParameters`` and the step's persistent-parameter refresh gather, are replaced by pulls
  from the owners' windows, all the parameters of one gather in one batched transport call;
  ``partition(has_been_updated=True)`` (writing modified values back into the shards) waits for every
  owner before returning;
* the coordinator's trace-consistency check (``assert_ints_same_as_other_ranks`` in
  ``reset_step``, broadcasts at the start of forwards) is skipped for ODC coordinators only: with
  ODC each rank keeps its own trace, and ranks may legitimately run different modules. The gate that
  skips it replaces the module function while ODC coordinators exist, and the original comes back when
  the last one is released.

Both go through :mod:`ds_odc.integration.patching` (one :class:`PatchSet` for the parameters' closures,
one for the coordinators' ``reset_step``), so ZeRO-3's own closures are kept aside there, not on the
parameters, and the engine's ``destroy()`` puts every one back (``PROCESS_WIDE`` in ``surface_process_wide.py``).
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero import partitioned_param_coordinator as _ppc
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from ds_odc.comm.batch import COMPLETED, Completion
from ds_odc.integration.patching import PatchSet

_trace_check_skip = threading.local()
#: Each parameter's gathers served by pulls; ZeRO-3's own closures are the originals it keeps (once, however
#: many ODC engines wrap the same parameters: the newest engine's pulls replace the older one's).
_pulls = PatchSet("ZeRO-3's parameter gathers, served by pulls from the ODC windows")
_trace_gate = PatchSet("ZeRO-3's trace-consistency check, skipped for ODC coordinators")
#: The coordinators of ODC engines: their ``reset_step`` skips the trace check.
_reset_steps = PatchSet("ODC coordinators' reset_step, without the trace-consistency check")


class PullHandle:
    """What the coordinator waits on: the transport's handle of the batched pull (CPU pulls complete
    eagerly; GPU pulls complete on the pull stream), then the parameters become available."""

    def __init__(self, params, transfer=COMPLETED):
        self._params = params
        self._transfer = transfer
        self._done = False

    def wait(self, **kwargs) -> None:
        if self._done:
            return
        self._transfer.wait()
        for param in self._params:
            param.ds_status = ZeroParamStatus.AVAILABLE
        self._done = True


def _pull_params(runtime, params) -> Completion:
    """Pull ``params`` (ZeRO-3 gathers a module's together) in one batched transport call: every
    owner's shard of every parameter. Their ``data`` is set at once; it is valid after the handle's
    ``wait()``. Measured against one pull per parameter in docs/benchmarks.md ("Batched pulls")."""
    if not params:
        return COMPLETED
    # on the compute device, as ZeRO-3 gathers (with offload_param the shards live in host memory)
    device = get_accelerator().current_device_name()
    fulls = [torch.empty(p.ds_numel, dtype=p.ds_tensor.dtype, device=device) for p in params]
    handle = runtime.pull_many([p.ds_id for p in params], fulls)
    for param, full in zip(params, fulls):
        param.data = full.view(param.ds_shape)
    return handle


def _pull_coalesced(runtime, params, safe_mode: bool = False, quantize: bool = False) -> PullHandle:
    params = list(params)
    for param in params:
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            raise RuntimeError(f"cannot pull a parameter that is not released: {param.ds_summary()}")
        param.ds_status = ZeroParamStatus.INFLIGHT
    try:
        transfer = _pull_params(runtime, params)
    except BaseException:
        for param in params:  # a pull only reads: leave the parameters as they were, so a retry can pull
            param.ds_status = ZeroParamStatus.NOT_AVAILABLE
        raise
    return PullHandle(params, transfer)


def _make_pull_all_gather(runtime, owner_param):

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        params = [owner_param] if param_list is None else list(param_list)
        missing = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if async_op:
            return [_pull_coalesced(runtime, missing)] if missing else []
        _pull_params(runtime, missing).wait()
        for param in missing:
            param.ds_status = ZeroParamStatus.AVAILABLE
        return None

    return all_gather


def _make_publishing_partition(runtime, partition):
    """``partition(has_been_updated=True)`` writes new values into this rank's shards (the exit of
    ``GatheredParameters(modifier_rank=...)``, which every rank calls): wait until every owner has,
    so that no rank pulls a half-written parameter."""

    def publishing_partition(param_list=None, hierarchy=0, has_been_updated=False, free_data=True):
        partition(param_list=param_list, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data)
        if has_been_updated:
            runtime.windows_rewritten("publishing parameters modified under GatheredParameters")

    return publishing_partition


def install_pulls(runtime, params) -> None:
    """Make every gather of ``params`` a pull through ``runtime``. ZeRO-3's own closures are kept
    aside (once, however many engines wrap the same parameters) for :func:`uninstall_pulls`."""
    pull_coalesced = functools.partial(_pull_coalesced, runtime)
    for param in params:
        _pulls.undo(param)  # another engine's pulls (the same parameters wrapped again): ZeRO-3's closures back
        _pulls.replace(param, "all_gather_coalesced", _instead(pull_coalesced), wraps=False)
        _pulls.replace(param, "all_gather", _instead(_make_pull_all_gather(runtime, param)), wraps=False)
        _pulls.replace(param, "partition", functools.partial(_make_publishing_partition, runtime), wraps=False)


def _instead(replacement):
    """A ``make`` for :meth:`PatchSet.replace` whose replacement does not call the original."""
    return lambda _original: replacement


def uninstall_pulls(params) -> None:
    """Give ``params`` back ZeRO-3's collective gathers (the engine is gone; the model stays usable)."""
    for param in params:
        _pulls.undo(param)


@contextlib.contextmanager
def _skipping_trace_checks():
    depth = getattr(_trace_check_skip, "depth", 0)
    _trace_check_skip.depth = depth + 1
    try:
        yield
    finally:
        _trace_check_skip.depth = depth


def _gated_assert_ints_same(original, ints):
    if getattr(_trace_check_skip, "depth", 0):
        return None
    return original(ints)


def skip_trace_checks(coordinator) -> None:
    """Turn off the cross-rank trace check for this coordinator (and no other) until
    :func:`restore_trace_checks`."""
    _trace_gate.replace(_ppc, "assert_ints_same_as_other_ranks",
                        lambda original: functools.partial(_gated_assert_ints_same, original))
    _reset_steps.replace(coordinator, "reset_step", _without_trace_check)


def _without_trace_check(reset_step):
    def reset_step_without_trace_check(*args, **kwargs):
        with _skipping_trace_checks():
            return reset_step(*args, **kwargs)

    return reset_step_without_trace_check


def restore_trace_checks(coordinator) -> None:
    """The ODC engine of ``coordinator`` is gone: its own ``reset_step`` back, and the module function
    back once no ODC coordinator is left."""
    _reset_steps.undo(coordinator)
    if not _reset_steps.active:
        _trace_gate.undo()
