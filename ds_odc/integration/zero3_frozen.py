"""Frozen engines on ODC: an engine without an optimizer pulls one-sided too.

A reference or reward model (TRL's ``prepare_deepspeed``, OpenRLHF's reference/reward engines, any
``deepspeed.initialize`` without an optimizer) is, on ZeRO-3, a ``DeepSpeedZeRoOffload``: ZeRO-3's
partitioning, module hooks and coordinator, whose gathers are collectives. Ranks that run different
numbers of micro-batches call it different numbers of times, so with parameters released after use (any
model of real size) one rank waits inside the reference model's all-gather while its peer waits at the
policy's step: a hang until the timeout.

Here such an engine gets a session of its own (:func:`ds_odc.runtime.open_session`) whose windows hold
only frozen shards (no accumulator, nothing to step): every parameter's shard moves into this rank's
window, and every gather becomes a one-sided pull (:mod:`ds_odc.integration.zero3_params`), with
ZeRO-3's own release, prefetch and persistence settings untouched. The open round runs at once, while
every rank is inside ``initialize``, so a forward never meets another rank: uneven forward counts just
work. Memory: the window replaces ZeRO-3's shard; start-up adds the session's collectives and one round.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ds_odc.config import ODCConfig
from ds_odc.errors import ODCConfigError
from ds_odc.integration import zero3_windows as windows
from ds_odc.integration.zero3_params import install_pulls, restore_trace_checks, skip_trace_checks, uninstall_pulls
from ds_odc.runtime import ODCRuntime, SessionPlan, Shard, open_session

if TYPE_CHECKING:
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload


@dataclass
class FrozenSession:
    """The ODC session of one frozen engine: its runtime, and the ZeRO-3 object whose gathers it serves."""

    runtime: ODCRuntime
    zero3: DeepSpeedZeRoOffload  # whose gathers this session serves

    def offload_states(self, engine, include, device, pin_memory: bool, non_blocking: bool) -> None:
        """``engine.offload_states(...)`` of a frozen engine, whose states ZeRO-3 refuses to move: it moves the one
        it has, its parameter window (``lp_params``), and refuses by name what it cannot."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
        from deepspeed.utils import logger

        others = [] if include is None else [s for s in include if s != OffloadStateTypeEnum.lp_params]
        if others:
            raise ODCConfigError(f"offload_states(include={[s.value for s in include]}): an engine without an "
                                 "optimizer has only its parameters (lp_params) to move: call offload_states() or "
                                 "offload_states(include=[OffloadStateTypeEnum.lp_params])")
        offload_param = engine.zero_offload_param()
        if offload_param is not None and offload_param.device != OffloadDeviceEnum.none:
            raise ODCConfigError("offload_states: the parameters of this engine are offloaded already "
                                 "(zero_optimization.offload_param), in host memory: there is nothing to move, so "
                                 "leave this engine out of offload_states() and reload_states()")
        if device == OffloadDeviceEnum.none:
            logger.warning("No device specified for offloading states.")  # DeepSpeed's answer
            return
        if device != OffloadDeviceEnum.cpu:
            raise ODCConfigError(f"offload_states(device={device}): only OffloadDeviceEnum.cpu is supported")
        if include is None or OffloadStateTypeEnum.lp_params in include:
            engine.empty_partition_cache()
            self.offload(pin_memory, non_blocking)

    def offload(self, pin_memory: bool, non_blocking: bool) -> None:
        """``engine.offload_states()``: the parameter window to host memory, with every rank (collective);
        the shards point at the host copy until :meth:`reload`."""
        self.runtime.offload_windows({"params"}, pin_memory, non_blocking)
        windows.bind_shards(windows.partitioned_params(self.zero3), self.runtime)

    def reload(self, non_blocking: bool) -> None:
        """``engine.reload_states()``: the window back on the device, mapped by every rank (collective)."""
        if self.runtime.reload_windows(non_blocking):
            windows.bind_shards(windows.partitioned_params(self.zero3), self.runtime)

    def release(self) -> None:
        """Gathers back to ZeRO-3's collectives, shards copied out of the window, the session closed."""
        params = windows.partitioned_params(self.zero3)
        uninstall_pulls(params)
        restore_trace_checks(self.zero3.get_param_coordinator())
        windows.move_shards_out(params)
        self.runtime.close()


def attach(offload: DeepSpeedZeRoOffload, options: ODCConfig, timeout_s: float) -> FrozenSession:
    """Serve ``offload``'s (a ``DeepSpeedZeRoOffload``'s) gathers from an ODC session of frozen shards.
    Collective: every rank builds its engine at the same point."""
    params = sorted(windows.partitioned_params(offload), key=lambda p: p.ds_id)
    if not params:
        raise ODCConfigError("the odc stage found no partitioned parameter in a model without an optimizer")
    dtypes = sorted({str(p.ds_tensor.dtype) for p in params})
    if len(dtypes) > 1:
        raise ODCConfigError(f"the odc stage needs one dtype for every parameter of a model without an optimizer "
                             f"(its window holds them all), found {', '.join(dtypes)}: cast the model first")
    names = windows.param_names(offload)
    plan = SessionPlan(trainable=[], frozen=[Shard(p.ds_id, p.ds_numel, p.ds_tensor.numel(), names.get(p.ds_id, ""))
                                             for p in params],
                       compute_dtype=params[0].ds_tensor.dtype, device=str(params[0].ds_tensor.device),
                       norm_groups=0, timeout_s=timeout_s, transport=options.transport, shm_dir=options.shm_dir,
                       stripe_numel=options.accumulator_stripe_numel, cross_node=options.cross_node,
                       replica_budget_gb=options.node_replica_budget_gb)
    runtime = open_session(plan, on_open=lambda: windows.publish_rebound_shards(offload, runtime))
    windows.announce_cross_node(runtime)
    try:
        windows.move_shards_in(params, runtime)
        runtime.open()  # now, while every rank is in initialize: no forward ever meets another rank
    except BaseException:
        windows.move_shards_out(params)
        runtime.close()
        raise
    install_pulls(runtime, params)
    skip_trace_checks(offload.get_param_coordinator())
    return FrozenSession(runtime, offload)
