"""ZeRO-3's buffers moved into ODC's windows, and back out.

ZeRO-3 keeps each rank's shards in a flat compute-dtype buffer (``lp_param_buffer``, viewed by every
parameter's ``ds_tensor``) and its gradient partitions in a flat fp32 buffer
(``grad_partitions_flat_buffer``, viewed per parameter). On ODC both live in memory peers reach: the
flat shard buffer *is* the trainable part of this rank's parameter window (so the optimizer's update
is already published, no copy), frozen shards follow it, and the gradient partitions *are* this rank's
block of the accumulator. Free functions over the optimizer, each undone by :func:`release_windows`.
"""
from __future__ import annotations

import torch

from ds_odc.config import ODCConfig
from ds_odc.errors import ODCConfigError
from ds_odc.runtime import ODCRuntime, SessionPlan, Shard

GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
ACCUMULATOR_DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def partitioned_params(optimizer) -> list:
    """Every parameter ZeRO-3 partitioned for this optimizer's module (trainable and frozen)."""
    module = getattr(optimizer, "module", None)  # absent if ZeRO-3's __init__ failed early
    return [] if module is None else [p for p in module.parameters() if hasattr(p, "ds_id")]


def param_names(module_owner) -> dict:
    """``ds_id`` -> the parameter's name in the module of ``module_owner`` (ZeRO-3's optimizer or its parameter
    offload), for cross_node "budget", which replicates whole layers named by these (shared parameters: the
    first name)."""
    module = getattr(module_owner, "module", None)
    names: dict = {}
    for name, param in ([] if module is None else module.named_parameters()):
        if hasattr(param, "ds_id"):
            names.setdefault(param.ds_id, name)
    return names


def frozen_params(optimizer) -> list:
    return sorted((p for p in partitioned_params(optimizer) if not p.requires_grad), key=lambda p: p.ds_id)


def _flat_shard_buffers(optimizer) -> list:
    """ZeRO-3's flat buffers of this rank's trainable shards, in window order: one on the device, or with
    ``offload_param`` one in host memory per parameter group (their sub-groups contiguous, in order)."""
    if optimizer.offload_param:
        return list(optimizer.param_groups_fp16_flat_cpu_memory)
    return [optimizer.lp_param_buffer]


def session_plan(optimizer, options: ODCConfig, timeout_s: float) -> SessionPlan:
    """What this optimizer asks of an ODC session: its trainable shards in flat-buffer order, then the
    frozen ones, in the compute dtype, where its shards live (host memory under ``offload_param``: the
    windows are then host shared memory, and pulls copy to the device)."""
    names = param_names(optimizer)
    trainable = [Shard(p.ds_id, p.ds_numel, p.partition_numel(), names.get(p.ds_id, ""))
                 for group in optimizer.fp16_groups for p in group]
    frozen = frozen_params(optimizer)
    buffers = _flat_shard_buffers(optimizer)
    compute_dtype = buffers[0].dtype
    if sum(s.shard_numel for s in trainable) != sum(b.numel() for b in buffers):
        raise RuntimeError("ZeRO-3 flat shard buffer does not match the ODC window layout")
    if any(p.ds_tensor.dtype != compute_dtype for p in frozen):
        raise ODCConfigError("the odc stage needs frozen parameters in the compute dtype of the model")
    device = str(buffers[0].device)
    return SessionPlan(trainable=trainable,
                       frozen=[Shard(p.ds_id, p.ds_numel, p.ds_tensor.numel(), names.get(p.ds_id, "")) for p in frozen],
                       compute_dtype=compute_dtype, device=device,
                       norm_groups=len(optimizer.fp16_groups), timeout_s=timeout_s, transport=options.transport,
                       shm_dir=options.shm_dir, stripe_numel=options.accumulator_stripe_numel,
                       accumulator_dtype=accumulator_dtype(options, compute_dtype, device),
                       exact=deterministic_sums(options, device), cross_node=options.cross_node,
                       replica_budget_gb=options.node_replica_budget_gb,
                       offloads=tuple(name for name, used in (("offload_param", optimizer.offload_param),
                                                              ("offload_optimizer", optimizer.offload_optimizer))
                                      if used))


def announce_cross_node(runtime: ODCRuntime) -> None:
    """Say in the log (rank 0, DeepSpeed's logger) how a job on several nodes holds its windows, and why."""
    choice = runtime.cross_node
    if choice is not None:
        from deepspeed.utils import logger

        if torch.distributed.get_rank() == 0:
            logger.info(f"ds_odc cross_node: {choice.reason}")


def accumulator_dtype(options: ODCConfig, compute_dtype: torch.dtype, device: str) -> torch.dtype:
    """The owners' accumulator dtype (``odc.accumulator_dtype``). "bf16" holds what ZeRO-3 holds for a bf16
    model (its gradient partitions in the model's dtype), so it is refused where it would be something else:
    a model that computes in another dtype (its pushes would be rounded to bf16 on the way in, a precision
    the model never asked for), and GPU ranks (the CUDA push kernel adds into fp32 accumulators)."""
    dtype = ACCUMULATOR_DTYPES[options.accumulator_dtype]
    if dtype is torch.bfloat16 and compute_dtype is not torch.bfloat16:
        raise ODCConfigError(f"zero_optimization.odc.accumulator_dtype='bf16' needs a bf16 model (the ds_config's "
                             f"bf16.enabled: true); this one computes in {compute_dtype}. Leave accumulator_dtype "
                             "out (fp32) for it")
    if dtype is torch.bfloat16 and not device.startswith("cpu"):
        raise ODCConfigError(f"zero_optimization.odc.accumulator_dtype='bf16' on {device}: bf16 accumulators have run "
                             "on CPU ranks only (the CUDA push kernel adds into fp32 accumulators); leave "
                             "accumulator_dtype out (fp32) on GPUs")
    return dtype


def deterministic_sums(options: ODCConfig, device: str) -> bool:
    """Whether the accumulators sum exactly (``odc.deterministic``; unset: whether
    ``torch.use_deterministic_algorithms(True)`` is on now, at initialize). Refused where it cannot hold."""
    asked = options.deterministic
    wanted = torch.are_deterministic_algorithms_enabled() if asked is None else asked
    if not wanted:
        return False
    if asked is None and "accumulator_dtype" in options.model_fields_set:
        raise ODCConfigError(f"torch.use_deterministic_algorithms(True) is on, and zero_optimization.odc."
                             f"accumulator_dtype={options.accumulator_dtype!r} sums pushes in arrival order: leave "
                             "accumulator_dtype out (the odc stage then sums exactly), or set odc.deterministic false")
    if not device.startswith("cpu"):
        raise ODCConfigError(f"zero_optimization.odc.deterministic on {device}: exact sums have run on CPU ranks only "
                             "(the GPU path is not validated yet); set odc.deterministic false on GPUs, or, under "
                             "torch.use_deterministic_algorithms(True), set it false explicitly")
    return True


def adopt_param_window(optimizer, runtime: ODCRuntime) -> None:
    """The flat shard buffer(s) and every frozen shard move into this rank's parameter window."""
    if optimizer.offload_param:
        _adopt_offloaded(optimizer, runtime.own_trainable_shards())
    else:
        runtime.own_trainable_shards().copy_(optimizer.lp_param_buffer)
    move_shards_in(frozen_params(optimizer), runtime)
    if not optimizer.offload_param:
        bind_param_window(optimizer, runtime)


def bind_param_window(optimizer, runtime: ODCRuntime) -> None:
    """Point ZeRO-3's flat shard buffer, its sub-group views and every shard (``ds_tensor``, frozen ones
    too) at this rank's parameter window as the runtime has it now: on the transport, or its host copy
    while it is away (``engine.offload_states``). No copy: the content is already there."""
    optimizer.lp_param_buffer = runtime.own_trainable_shards()
    optimizer.fp16_partitioned_groups_flat = []
    optimizer._set_fp16_partitioned_groups_flat()
    for sub_group_id in range(len(optimizer.fp16_groups)):
        optimizer._unflatten_partitioned_parameters(sub_group_id)
    bind_shards(frozen_params(optimizer), runtime)


def move_shards_in(params, runtime: ODCRuntime) -> None:
    """Copy each parameter's shard (``ds_tensor``) into its place in this rank's window, and point it there."""
    for param in params:
        runtime.own_shard(param.ds_id).copy_(param.ds_tensor.data.reshape(-1))
    bind_shards(params, runtime)


def bind_shards(params, runtime: ODCRuntime) -> None:
    """Point each parameter's shard (``ds_tensor``) at its place in this rank's window (no copy)."""
    for param in params:
        param.ds_tensor.data = runtime.own_shard(param.ds_id).view(param.ds_tensor.shape)


def move_shards_out(params) -> None:
    """Each parameter's shard copied out of the window into private memory (the window may then go)."""
    for param in params:
        if param.ds_tensor is not None:
            param.ds_tensor.data = param.ds_tensor.data.clone()


def _adopt_offloaded(optimizer, trainable) -> None:
    """``offload_param``: each parameter group's host buffer becomes its slice of the window, and each
    sub-group's shards are moved into it as ZeRO-3 moved them into its own buffer (``_move_to_flat_buffer``)."""
    groups, offset = [], 0
    for buffer in optimizer.param_groups_fp16_flat_cpu_memory:
        groups.append(trainable.narrow(0, offset, buffer.numel()))
        offset += buffer.numel()
    flats, offset = [], 0
    for sub_group in optimizer.fp16_groups:
        numel = sum(p.partition_numel() for p in sub_group)
        flat = trainable.narrow(0, offset, numel)
        optimizer._move_to_flat_buffer(sub_group, flat, avoid_copy=False)
        flats.append(flat)
        offset += numel
    optimizer.fp16_partitioned_groups_flat = flats
    optimizer.param_groups_fp16_flat_cpu_memory = groups


def adopt_accumulator(optimizer, runtime: ODCRuntime) -> None:
    """This rank's block of the fp32 accumulator stands in for ZeRO-3's gradient partition buffer (the
    accumulator as the runtime has it now: on the transport, or its host copy while it is away), and
    ZeRO-3's per-parameter views and the ``averaged_gradients`` its backward set point into it."""
    optimizer.grad_partitions_flat_buffer = runtime.own_gradients()
    views = getattr(optimizer, GRAD_PARTITIONS)
    for key, slot in runtime.layout.slots.items():
        if slot.grad_offset is not None:
            views[key] = runtime.own_gradient(key)
    for sub_group_id in list(optimizer.averaged_gradients):
        optimizer.averaged_gradients[sub_group_id] = accumulator_views(optimizer, optimizer.fp16_groups[sub_group_id])


def accumulator_views(optimizer, sub_group) -> list:
    """ZeRO-3's ``averaged_gradients`` of one sub-group on ODC: the accumulator's views (zeros for a
    frozen parameter), what ZeRO-3's backward epilogue sets and its step reads."""
    views = getattr(optimizer, GRAD_PARTITIONS)
    return [views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor) for p in sub_group]


def publish_rebound_shards(optimizer, runtime: ODCRuntime) -> None:
    """Copy shards that ``ds_tensor.data = t`` moved out of the window back into it (the open round
    runs this before its first rendezvous; in-place writes land in the window already)."""
    for param in partitioned_params(optimizer):
        if param.ds_id not in runtime.layout.slots or param.ds_tensor is None:
            continue
        view = runtime.own_shard(param.ds_id)
        shard = param.ds_tensor
        if shard.data_ptr() == view.data_ptr() and shard.numel() == view.numel():
            continue
        if shard.numel() != view.numel():
            raise ValueError(f"parameter {param.ds_id} ({tuple(param.ds_shape)}): its shard (ds_tensor) was replaced "
                             f"by one of {shard.numel()} elements, the partition has {view.numel()}")
        view.copy_(shard.data.reshape(-1))
        shard.data = view.view(shard.shape)


def release_windows(optimizer) -> None:
    """Shards copied out of the windows into private memory, ZeRO-3's buffers dropped: the model stays
    usable after the engine (DeepSpeed keeps a destroyed engine's module reachable, and whatever still
    viewed a window would keep its shared pages, counted against shm_dir, for the life of the process)."""
    move_shards_out(partitioned_params(optimizer))
    optimizer.lp_param_buffer = None
    optimizer.param_groups_fp16_flat_cpu_memory = []
    optimizer.fp16_partitioned_groups_flat = []
    optimizer.grad_partitions_flat_buffer = None
    getattr(optimizer, GRAD_PARTITIONS, {}).clear()
    optimizer.averaged_gradients = {}
