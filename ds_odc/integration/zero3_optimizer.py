"""``ODCStage3Optimizer``: DeepSpeed's ZeRO-3 optimizer with its communication replaced.

Kept from ZeRO-3: partitioning, module hooks, the coordinator, IPG bucketing, fp32 master weights,
the optimizer update, ``state_dict`` / ``load_state_dict`` (so checkpoints keep the ZeRO-3 layout).
Replaced, each by one override below:

* ``_create_fp16_partitions_with_defragmentation``: the flat compute-dtype shard buffer is moved
  into this rank's parameter window, so the optimizer writes updated shards straight into the
  memory peers read (publishing costs no copy); frozen shards follow it in the window;
* ``__reduce_and_partition_ipg_grads`` (the only path to the reduce-scatter): push each gradient
  to its owners' fp32 accumulators; the accumulator *is* ``grad_partitions_flat_buffer``;
* ``step``: the runtime's step protocol (fence, norm, update, publish) drives it; this adapter only
  supplies the norm inputs (ZeRO-3's per-sub-group squared norms of the fenced, normalised shard)
  and the update (ZeRO-3's own ``step``, which then reads the protocol's norms);
* ``_get_norm_groups``: the norm round's result instead of an all-reduce per sub-group, so ZeRO-3's
  step makes no collective and its overflow branch cannot change the number of rounds;
* ``has_overflow`` (fp16's dynamic loss scaling asks it): the norm round's verdict (any rank's
  gradient not finite) instead of an all-reduce of a local flag, so every rank skips the same steps
  and updates its loss scale the same way;
* ``_post_step``: the persistent-parameter refresh pulls after publishing instead of all-gathering;
* ``reduce_ready_partitions_and_remove_grads`` (and a forward pre-hook on every module): a heartbeat
  for peers waiting at the step, so that only a peer without progress times out.

ZeRO-3's gradient reads before the step (``get_fp32_grad_partitions``, ``_get_fp32_grad_state_partition``
under ``safe_get_full_grad`` / ``safe_get_local_grad`` / ``safe_set_*_grad``) first run a gradient
fence (collective, as the reads they replace are in ZeRO-3); ``zero_grad`` called outside a step
discards every rank's gradients (collective). Shards rebound by ``ds_tensor.data = t`` before the
first rendezvous are copied back into the window by the open round (see :mod:`ds_odc.runtime.step`).
"""
from __future__ import annotations

import contextlib

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.runtime.zero.utils import get_norm_dtype

from ds_odc.comm import WindowSpec, create_transport
from ds_odc.config import ODCConfig
from ds_odc.errors import ODCConfigError
from ds_odc.integration.deepspeed_shm import release_allreduce_buffer
from ds_odc.integration.nodes import job_nodes, job_store
from ds_odc.integration.timeouts import resolve_timeout_s
from ds_odc.integration.zero3_params import install_pulls, skip_trace_checks, uninstall_pulls
from ds_odc.runtime import GlobalNorms, MicroBatchLedger, ODCRuntime, Phase, StepUpdate, WindowLayout
from ds_odc.runtime.exchange import CrossNodeExchange, FailureBoard

_GRAD_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"


class _Zero3Update(StepUpdate):
    """ZeRO-3's half of an ODC step: its norm arithmetic and its optimizer update."""

    def __init__(self, optimizer: "ODCStage3Optimizer"):
        self.optimizer = optimizer
        self.gradient_accumulation_steps = optimizer.gradient_accumulation_steps

    def squared_norms(self) -> torch.Tensor:
        """Point ``averaged_gradients`` at the fenced accumulator (a rank with no micro-batch never
        ran ZeRO-3's epilogue) and sum squared norms per sub-group as ``get_grad_norm_direct`` does."""
        optimizer = self.optimizer
        views = getattr(optimizer, _GRAD_PARTITIONS)
        squares = []
        for sub_group_id, sub_group in enumerate(optimizer.fp16_groups):
            grads = [views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor) for p in sub_group]
            optimizer.averaged_gradients[sub_group_id] = grads
            norms = [g.to(get_norm_dtype()).norm(2) for g in grads]
            squares.append(torch.sum(torch.pow(torch.stack(norms), 2)) if norms else torch.zeros((), dtype=torch.float64))
        return torch.stack(squares).to(torch.float64).cpu()

    def apply(self, norms: GlobalNorms) -> None:
        self.optimizer._odc_norms = norms
        self.optimizer._odc_stage_offload_grads()
        try:
            DeepSpeedZeroOptimizer_Stage3.step(self.optimizer)
        finally:
            self.optimizer._odc_norms = None


class ODCStage3Optimizer(DeepSpeedZeroOptimizer_Stage3):

    def __init__(self, *args, odc_options: ODCConfig, odc_ledger: MicroBatchLedger, **kwargs):
        self.odc_options = odc_options
        self._odc_ledger = odc_ledger
        self.odc: ODCRuntime | None = None
        self._odc_norms: GlobalNorms | None = None
        self.odc_gradients_seen = 0  # gradients handed to ZeRO-3's bucketing, see ODCEngine.backward
        self.odc_inside_engine_step = False  # set by the engine around its step (its zero_grad is local)
        try:
            super().__init__(*args, **kwargs)
            self._adopt_accumulator_as_grad_buffer()
        except BaseException:
            self._release_odc()  # the windows may exist: this optimizer will never be used
            raise
        install_pulls(self.odc, self._odc_all_params())
        skip_trace_checks(self.parameter_offload.get_param_coordinator())
        self._odc_heartbeat_hooks = [m.register_forward_pre_hook(self._odc_heartbeat) for m in self.module.modules()]

    def _odc_heartbeat(self, *unused) -> None:
        """Progress signal for peers waiting at the step: every module forward and every gradient
        (pulls and pushes beat too, but prefetch and bucketing make those bursty)."""
        self.odc.transport.heartbeat()

    def reduce_ready_partitions_and_remove_grads(self, param):
        self.odc_gradients_seen += 1
        self.odc.transport.heartbeat()
        return super().reduce_ready_partitions_and_remove_grads(param)

    # -- construction ------------------------------------------------------------------------------
    def _odc_all_params(self):
        module = getattr(self, "module", None)  # absent if ZeRO-3's __init__ failed early
        return [] if module is None else [p for p in module.parameters() if hasattr(p, "ds_id")]

    def _create_fp16_partitions_with_defragmentation(self, fp16_param_groups):
        super()._create_fp16_partitions_with_defragmentation(fp16_param_groups)
        if self.offload_param:
            raise ODCConfigError("zero_optimization.offload_param is not supported with the odc stage")
        if getattr(self, "swap_optimizer", False):
            raise ODCConfigError("zero_optimization.offload_optimizer to NVMe is not supported with the odc stage")
        self._build_windows()

    def _build_windows(self) -> None:
        import deepspeed.comm as dist

        world = dist.get_world_size(group=self.dp_process_group)
        if world != dist.get_world_size():
            raise ODCConfigError("the odc stage needs the data-parallel group to span every rank "
                                 "(no model, tensor, pipeline or sequence parallelism yet)")
        timeout_s = resolve_timeout_s(self.odc_options.timeout_s)
        nodes = job_nodes(timeout_s)
        layout = WindowLayout(nodes.node_count)
        for sub_group in self.fp16_groups:
            for param in sub_group:
                layout.add_trainable(param.ds_id, param.ds_numel, param.partition_numel())
        frozen = sorted((p for p in self._odc_all_params() if not p.requires_grad), key=lambda p: p.ds_id)
        for param in frozen:
            layout.add_frozen(param.ds_id, param.ds_numel, param.ds_tensor.numel())
        if layout.trainable_numel != self.lp_param_buffer.numel():
            raise RuntimeError("ZeRO-3 flat shard buffer does not match the ODC window layout")
        compute_dtype = self.lp_param_buffer.dtype
        if any(p.ds_tensor.dtype != compute_dtype for p in frozen):
            raise ODCConfigError("the odc stage needs frozen parameters in the compute dtype of the model")

        transport = create_transport(self.odc_options.transport, rank=nodes.local_rank, world_size=nodes.local_world,
                                     timeout_s=timeout_s, device=str(self.lp_param_buffer.device),
                                     shm_dir=self.odc_options.shm_dir,
                                     stripe_numel=self.odc_options.accumulator_stripe_numel,
                                     group=nodes.node_group, first_rank=nodes.first_rank)
        accumulator_dtype = {"fp32": torch.float32, "fp64": torch.float64}[self.odc_options.accumulator_dtype]
        transport.allocate(WindowSpec(layout.window_numel, compute_dtype, layout.accumulator_numel,
                                      ODCRuntime.exchange_width(len(self.fp16_groups)), accumulator_dtype))
        release_allreduce_buffer(dist.get_rank())  # allocate() ended with a barrier of the node's ranks
        exchange = None
        if nodes.node_count > 1:
            exchange = CrossNodeExchange(nodes.cross_group, layout, FailureBoard(job_store(timeout_s), nodes.board_key),
                                         timeout_s, dist.get_rank(), heartbeat=transport.heartbeat)
        self.odc = ODCRuntime(transport, layout, self._odc_ledger, on_open=self._odc_publish_rebound_shards,
                              nodes=exchange)
        self.odc_nodes = nodes

        window = transport.local_param_window()
        trainable = window.narrow(0, *layout.trainable_block(nodes.node))
        trainable.copy_(self.lp_param_buffer)
        self.lp_param_buffer = trainable
        self.fp16_partitioned_groups_flat = []
        self._set_fp16_partitioned_groups_flat()
        for sub_group_id in range(len(self.fp16_groups)):
            self._unflatten_partitioned_parameters(sub_group_id)
        for param in frozen:
            view = self._odc_window_view(window, param.ds_id)
            view.copy_(param.ds_tensor.data.reshape(-1))
            param.ds_tensor.data = view

    def _odc_publish_rebound_shards(self) -> None:
        """Copy shards that ``ds_tensor.data = t`` moved out of the window back into it (the open
        round runs this before its first rendezvous; in-place writes land in the window already)."""
        window = self.odc.transport.local_param_window()
        for param in self._odc_all_params():
            if param.ds_id not in self.odc.layout.slots or param.ds_tensor is None:
                continue
            view = self._odc_window_view(window, param.ds_id)
            shard = param.ds_tensor
            if shard.data_ptr() == view.data_ptr() and shard.numel() == view.numel():
                continue
            if shard.numel() != view.numel():
                raise ValueError(f"parameter {param.ds_id} ({tuple(param.ds_shape)}): its shard (ds_tensor) was replaced "
                                 f"by one of {shard.numel()} elements, the partition has {view.numel()}")
            view.copy_(shard.data.reshape(-1))
            shard.data = view.view(shard.shape)

    def _odc_window_view(self, window: torch.Tensor, key: int) -> torch.Tensor:
        """This rank's own shard of parameter ``key`` in its window (its node's block)."""
        slot = self.odc.layout.slots[key]
        return window.narrow(0, self.odc.layout.param_offset(slot, self.odc_nodes.node), slot.shard_numel)

    def _adopt_accumulator_as_grad_buffer(self) -> None:
        """Let this rank's block of the fp32 accumulator window stand in for ZeRO-3's gradient
        partition buffer."""
        accumulator = self.odc.transport.local_grad_accumulator()
        layout, node = self.odc.layout, self.odc_nodes.node
        self.grad_partitions_flat_buffer = accumulator.narrow(0, *layout.trainable_block(node))
        views = getattr(self, _GRAD_PARTITIONS)
        for key, slot in layout.slots.items():
            if slot.grad_offset is not None:
                views[key] = accumulator.narrow(0, layout.grad_offset(slot, node), slot.shard_numel)

    # -- backward: push instead of reduce-scatter -------------------------------------------------
    @torch.no_grad()
    def _odc_push_bucket(self, communication_data_type: torch.dtype) -> None:
        bucket = self.ipg_buckets[communication_data_type]
        # On GPU, push on ZeRO-3's reduce side stream, where its reduce-scatter ran: the bucket was filled
        # on that stream, its next fill is ordered after these pushes, and compute does not wait for them.
        stream = self.reduce_and_partition_stream  # None on CPU
        with contextlib.nullcontext() if stream is None else get_accelerator().stream(stream):
            for param in bucket.params:
                self.odc.push(param.ds_id, param.grad.reshape(-1))
                param.grad = None
        bucket.params.clear()
        bucket.elements = 0
        bucket.process_group = None

    _DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads = _odc_push_bucket

    # -- gradients read or dropped before the step ----------------------------------------------------
    def _odc_between_steps(self) -> bool:
        return self.odc is not None and self.odc.phase in (Phase.IDLE, Phase.ACCUMULATING)

    def _odc_fence_for_read(self, what: str) -> None:
        """Make every rank's pushes visible before a ZeRO-3 gradient read between backward and step."""
        if self._odc_between_steps():
            self.odc.sync_gradients(what)
            self._odc_point_averaged_gradients_at_accumulator()
            self._odc_stage_offload_grads()

    def _odc_stage_offload_grads(self) -> None:
        """Optimizer offload: ZeRO-3's step (and its gradient reads) use each sub-group's host fp32
        gradient buffer, which ZeRO-3 fills from its partitions at the boundary. On ODC the
        partitions are the accumulator, so copy it there (a device-to-host copy on GPU, once per step)."""
        if not self.offload_optimizer:
            return
        views = getattr(self, _GRAD_PARTITIONS)
        for sub_group_id, sub_group in enumerate(self.fp16_groups):
            host_grads = self.fp32_partitioned_groups_flat[sub_group_id].grad
            for param in sub_group:
                _, offset, numel = self.grad_position[self.get_param_id(param)]
                target = host_grads.narrow(0, offset, numel)
                if param.requires_grad:
                    target.copy_(views[param.ds_id])
                else:
                    target.zero_()

    def _odc_offload_grad_written(self, param) -> None:
        """A gradient set through ZeRO-3 went to the host buffer under offload: the accumulator, which
        the step copies from, must hold it too."""
        if self.offload_optimizer and param.requires_grad:
            group, offset, numel = self.grad_position[self.get_param_id(param)]
            getattr(self, _GRAD_PARTITIONS)[param.ds_id].copy_(
                self.fp32_partitioned_groups_flat[group].grad.narrow(0, offset, numel))

    def set_fp32_grad_for_param(self, value, param):
        super().set_fp32_grad_for_param(value, param)
        self._odc_offload_grad_written(param)

    def set_local_grad_for_param(self, value, param):
        super().set_local_grad_for_param(value, param)
        self._odc_offload_grad_written(param)

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        """ZeRO-3's (``safe_update_full_grad_vectorized``), after a gradient fence."""
        self._odc_fence_for_read("safe_update_full_grad_vectorized")
        super().update_fp32_grad_for_param_vectorized(update_func, param_list)
        for param in param_list:
            self._odc_offload_grad_written(param)

    def _odc_point_averaged_gradients_at_accumulator(self) -> None:
        """What ZeRO-3's backward epilogue does: a rank that ran no backward never did it."""
        views = getattr(self, _GRAD_PARTITIONS)
        for sub_group_id, sub_group in enumerate(self.fp16_groups):
            self.averaged_gradients[sub_group_id] = [
                views[p.ds_id] if p.requires_grad else torch.zeros_like(p.ds_tensor) for p in sub_group]

    def get_fp32_grad_partitions(self):
        """ZeRO-3's, after a gradient fence (collective on ODC)."""
        self._odc_fence_for_read("optimizer.get_fp32_grad_partitions()")
        return super().get_fp32_grad_partitions()

    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        self._odc_fence_for_read("reading or writing a gradient partition (safe_get/set_*_grad)")
        return super()._get_fp32_grad_state_partition(param, release_swap_buffers)

    def zero_grad(self, set_to_none=True):
        """Inside a step, ZeRO-3's (the accumulators are cleared by the step itself). Outside one,
        called by every rank as ZeRO-3 expects, it drops every rank's gradients since the last step
        (ZeRO-3's next backward overwrites its partitions): a collective discard."""
        if self._odc_between_steps() and not self.odc_inside_engine_step:
            self.odc.discard_gradients("optimizer.zero_grad() outside a step")
        return super().zero_grad(set_to_none=set_to_none)

    # -- the step ----------------------------------------------------------------------------------
    def step(self, closure=None):
        """The boundary step: the runtime's step protocol, then the persistent-parameter refresh."""
        self.odc.step(_Zero3Update(self))
        self._pull_released_persistent_params()

    def _get_norm_groups(self):
        """The norm round's per-sub-group norms (no collective), with ZeRO-3's -1 for inf/nan."""
        if self._odc_norms is None:
            raise RuntimeError("ZeRO-3 asked for gradient norms outside an ODC step")
        norms = self._odc_norms.group_norms()
        sentinel = torch.tensor(-1.0, dtype=torch.float)
        # the dtype ZeRO-3's own norms have: its offload path computes them in fp32
        dtype = torch.float32 if self.offload_optimizer else get_norm_dtype()
        return [torch.where(n.isinf() | n.isnan(), sentinel, n).to(self.device, dtype) for n in norms]

    def has_overflow(self, partition_gradients=True):
        """Inside an ODC step: whether any rank's gradient is not finite (the norm round's result,
        the same on every rank). ZeRO-3's check would all-reduce a flag read from this owner's shard."""
        if self._odc_norms is None:
            return super().has_overflow(partition_gradients)
        return not self._odc_norms.finite

    def _post_step(self, timer_names):
        persistent, self.persistent_parameters = self.persistent_parameters, []
        try:
            super()._post_step(timer_names)
        finally:
            self.persistent_parameters = persistent

    def _pull_released_persistent_params(self) -> None:
        released = [p for p in self.persistent_parameters if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if released:
            released[0].all_gather(param_list=released)

    # -- checkpoints and teardown ------------------------------------------------------------------
    def odc_republish(self) -> None:
        """After a checkpoint load rewrote the shards: drop stale full copies, let every owner
        finish writing, then refresh persistent parameters. Called by ``ODCEngine.load_checkpoint``."""
        self._partition_all_parameters()
        self.odc.windows_rewritten("re-publishing shards after load_checkpoint")
        self._pull_released_persistent_params()

    def destroy(self):
        """Release windows and hooks; the model's parameters go back to ZeRO-3's collective gathers,
        their shards copied out of the windows into private memory. DeepSpeed keeps a destroyed
        engine's module reachable (its forward hooks hold the optimizer), so whatever still viewed a
        window would keep its shared pages, counted against shm_dir, for the life of the process."""
        for hook in getattr(self, "_odc_heartbeat_hooks", ()):
            hook.remove()
        try:
            super().destroy()
        finally:
            self._release_odc()

    def _release_odc(self) -> None:
        """Parameters back to ZeRO-3's gathers and private shards; windows and transport released."""
        uninstall_pulls(self._odc_all_params())
        if self.odc is None:
            return
        for param in self._odc_all_params():
            if param.ds_tensor is not None:
                param.ds_tensor.data = param.ds_tensor.data.clone()
        self.lp_param_buffer = None
        self.fp16_partitioned_groups_flat = []
        self.grad_partitions_flat_buffer = None
        getattr(self, _GRAD_PARTITIONS, {}).clear()
        self.averaged_gradients = {}
        self.odc.close()
