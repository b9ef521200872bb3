"""``ODCStage3Optimizer``: DeepSpeed's ZeRO-3 optimizer with its communication replaced.

Kept from ZeRO-3: partitioning, module hooks, the coordinator, IPG bucketing, fp32 master weights,
the optimizer update, ``state_dict`` / ``load_state_dict`` (so checkpoints keep the ZeRO-3 layout).
Replaced, each by one override below:

* ``_create_fp16_partitions_with_defragmentation``: opens the ODC session (``ds_odc.runtime.session``)
  and moves the flat shard buffer into this rank's parameter window (:mod:`.zero3_windows`);
* ``__reduce_and_partition_ipg_grads`` (the only path to the reduce-scatter): push each gradient
  to its owners' accumulators; the accumulator *is* ``grad_partitions_flat_buffer``;
* ``reduce_ready_partitions_and_remove_grads``: a heartbeat per gradient, and no coalescing
  (``engine.coalesce_grad_reduction()`` saves no collective on ODC);
* the step (this file is the one place ZeRO-3's ``step`` is re-entered, and it holds every override
  that step calls): ``step`` runs the runtime's protocol (fence, norm, update, publish), whose update
  re-enters ZeRO-3's own ``step``; inside it ``_get_norm_groups`` and ``has_overflow`` answer from the
  norm round, ``_post_step`` skips the persistent-parameter all-gather, and ``zero_grad`` is ZeRO-3's.
  What they read is one :class:`StepContext`, set for the duration of one boundary ``engine.step()``.

ZeRO-3's gradient reads between backward and step (``get_fp32_grad_partitions``, ``safe_get_*_grad``,
``safe_set_*_grad``, ``_get_norm_groups``) first run a gradient fence (collective, as the reads they
replace are in ZeRO-3); ``zero_grad`` called outside a step discards every rank's gradients (collective).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from ds_odc.comm.schedule import point
from ds_odc.config import ODCConfig
from ds_odc.errors import ODCConfigError, ODCStateError
from ds_odc.integration import zero3_windows as windows
from ds_odc.integration.clean_exit import release_allreduce_buffer
from ds_odc.integration.surface import has
from ds_odc.integration.surface_table import COALESCE_GRAD_REDUCTION, IPG_BUCKET_GROUP, NORM_DTYPE
from ds_odc.integration.timeouts import resolve_timeout_s
from ds_odc.integration.zero3_params import install_pulls, restore_trace_checks, skip_trace_checks, uninstall_pulls
from ds_odc.runtime import GlobalNorms, ODCRuntime, Phase, StepTotals, StepUpdate, open_session

#: ZeRO-3's offloadable states that are ODC windows, and which window each is.
WINDOW_STATES = {OffloadStateTypeEnum.lp_params: "params", OffloadStateTypeEnum.lp_grads: "grads"}


@dataclass
class StepContext:
    """One boundary ``engine.step()`` as ZeRO-3's code inside it sees it. The engine opens it around its
    model step (:meth:`ODCStage3Optimizer.step_context`), so that the ``zero_grad`` DeepSpeed calls after
    the step is local; the protocol's update fills in the norm round's result before re-entering ZeRO-3's
    step, and the fence's totals come back for ``global_samples``."""

    norms: Optional[GlobalNorms] = None
    totals: Optional[StepTotals] = None


class _Zero3Update(StepUpdate):
    """ZeRO-3's half of an ODC step: its norm arithmetic and its optimizer update."""

    def __init__(self, optimizer: "ODCStage3Optimizer", context: StepContext):
        self.optimizer, self.context = optimizer, context
        self.gradient_accumulation_steps = optimizer.gradient_accumulation_steps

    def squared_norms(self) -> torch.Tensor:
        return self.optimizer._odc_squared_norms()

    def apply(self, norms: GlobalNorms) -> None:
        optimizer = self.optimizer
        optimizer._odc_point_averaged_gradients_at_accumulator()  # a rank with no micro-batch never ran the epilogue
        optimizer._odc_stage_offload_grads()
        self.context.norms = norms
        DeepSpeedZeroOptimizer_Stage3.step(optimizer)


def _norm_dtype() -> torch.dtype:
    """The dtype ZeRO-3 sums squared gradient norms in (``surface_table.NORM_DTYPE``): ``get_norm_dtype()``,
    float64 before DeepSpeed had it (``.double().norm(2)``)."""
    if has(NORM_DTYPE):
        from deepspeed.runtime.zero.utils import get_norm_dtype

        return get_norm_dtype()
    return torch.float64


class ODCStage3Optimizer(DeepSpeedZeroOptimizer_Stage3):
    """See the module docstring. ``odc`` is the :class:`~ds_odc.runtime.ODCRuntime` (its transport,
    layout and protocol); ``odc_step`` the :class:`StepContext` of the engine step in progress."""

    def __init__(self, *args, odc_options: ODCConfig, **kwargs):
        self._odc_options = odc_options  # the micro-batch ledger is the session's (SessionPlan.ledger)
        self._odc_runtime: ODCRuntime | None = None  # opened by _create_fp16_partitions_with_defragmentation
        self.odc_step: StepContext | None = None
        self.odc_gradients_seen = 0  # gradients handed to ZeRO-3's bucketing, see ODCEngine.backward
        self._odc_hooks: list = []
        try:
            super().__init__(*args, **kwargs)
            windows.adopt_accumulator(self, self.odc)
        except BaseException:
            self._release_odc()  # the windows may exist: this optimizer will never be used
            raise
        install_pulls(self.odc, windows.partitioned_params(self))
        skip_trace_checks(self.parameter_offload.get_param_coordinator())
        self._odc_hooks = [m.register_forward_pre_hook(self._odc_heartbeat) for m in self.module.modules()]

    def _odc_heartbeat(self, *unused) -> None:
        """Progress signal for peers waiting at the step: every module forward and every gradient
        (pulls and pushes beat too, but prefetch and bucketing make those bursty)."""
        self.odc.transport.heartbeat()

    @property
    def odc(self) -> ODCRuntime:
        """The ODC runtime, opened by ZeRO-3's construction of the partitions (so from the end of ``__init__`` on)."""
        if self._odc_runtime is None:
            raise ODCStateError("this ODC optimizer has no runtime yet: ZeRO-3 has not built its partitions")
        return self._odc_runtime

    # -- construction ------------------------------------------------------------------------------
    def _create_fp16_partitions_with_defragmentation(self, fp16_param_groups):
        super()._create_fp16_partitions_with_defragmentation(fp16_param_groups)
        if getattr(self, "swap_optimizer", False):
            raise ODCConfigError("zero_optimization.offload_optimizer to NVMe is not supported with the odc stage")
        import deepspeed.comm as dist

        data_parallel, world = dist.get_world_size(group=self.dp_process_group), dist.get_world_size()
        if data_parallel != world:
            raise ODCConfigError(
                f"the odc stage needs the data-parallel group to span every rank; this one holds {data_parallel} of "
                f"the {world} ranks: tensor, pipeline or other model parallelism (an mpu whose data-parallel group "
                "is smaller than the world) is not supported. Pass an mpu whose data-parallel group is every rank, "
                "or none (Ulysses sequence parallelism through ALST's mpu is supported: its sequence-data-parallel "
                "group spans every rank)")
        plan = windows.session_plan(self, self._odc_options, resolve_timeout_s(self._odc_options.timeout_s))
        self._odc_runtime = open_session(plan, on_open=lambda: windows.publish_rebound_shards(self, self.odc),
                                         on_gradients_moved=lambda: windows.adopt_accumulator(self, self.odc))
        windows.announce_cross_node(self._odc_runtime)
        release_allreduce_buffer(dist.get_rank())  # every rank passed the session's start-up collectives
        windows.adopt_param_window(self, self.odc)

    # -- backward: push instead of reduce-scatter -------------------------------------------------
    def reduce_ready_partitions_and_remove_grads(self, param):
        """A gradient is ready: bucketed and pushed, as ZeRO-3 buckets and reduce-scatters it.

        Inside ``engine.coalesce_grad_reduction()`` ZeRO-3 leaves the gradient on the parameter, so that
        the backward calls of the block are summed there, in the compute dtype (bf16), and reduced once at
        the block's exit. ODC has no collective to save, and a push adds into the fp32 accumulator: it
        pushes each gradient as it comes, unbucketed (a leaf module's hook may run several times in one
        backward; each time it pushes what autograd accumulated since), so that the block changes nothing
        (summing in bf16 first was 1e-3 away after one Adam step)."""
        self.odc_gradients_seen += 1
        self.odc.transport.heartbeat()
        if has(COALESCE_GRAD_REDUCTION) and self._coalesce_grad_reduction:
            if param.grad is not None and param.grad.numel():  # empty: a leaf hook's zero-fill of a released parameter
                self.odc.push(param.ds_id, param.grad.reshape(-1))
            param.grad = None
            return None
        return self.reduce_independent_p_g_buckets_and_remove_grads(param)

    @torch.no_grad()
    def _odc_push_bucket(self, communication_data_type: torch.dtype) -> None:
        bucket = self.ipg_buckets[communication_data_type]
        if len({p.ds_id for p in bucket.params}) != len(bucket.params):  # ZeRO-3 asserts the same
            seen = collections.Counter(p.ds_id for p in bucket.params)  # by id: == on tensors compares elements
            twice = sorted(ds_id for ds_id, times in seen.items() if times > 1)
            raise RuntimeError(f"parameters {twice} reached ZeRO-3's gradient bucket twice in one backward (a ZeRO-3 "
                               "leaf module run more than once per forward?): their gradients cannot be pushed once "
                               "each")
        # On GPU, push on ZeRO-3's reduce side stream, where its reduce-scatter ran: the bucket was filled
        # on that stream, its next fill is ordered after these pushes, and compute does not wait for them.
        stream = self.reduce_and_partition_stream  # None on CPU
        with contextlib.nullcontext() if stream is None else get_accelerator().stream(stream):
            for param in bucket.params:
                self.odc.push(param.ds_id, param.grad.reshape(-1))
                param.grad = None
        bucket.params.clear()
        bucket.elements = 0
        if has(IPG_BUCKET_GROUP):
            bucket.process_group = None

    _DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads = _odc_push_bucket

    # -- gradients read or dropped between backward and step -------------------------------------------
    def _odc_between_steps(self) -> bool:
        return self._odc_runtime is not None and self._odc_runtime.phase in (Phase.IDLE, Phase.ACCUMULATING)

    def _odc_fence_for_read(self, what: str) -> None:
        """Make every rank's pushes visible before a ZeRO-3 gradient read between backward and step: ZeRO-3's
        partitions are then a copy of them, unchanged by peers' later pushes, until this rank's next push or
        step; writes into it reach the step ([Note: reads are snapshots], ``ds_odc.runtime.gradient_reads``)."""
        if self._odc_between_steps():
            if self.odc.sync_gradients(what):
                windows.adopt_accumulator(self, self.odc)
            self._odc_point_averaged_gradients_at_accumulator()
            self._odc_stage_offload_grads()
            point("gradient_read.return")

    def _odc_point_averaged_gradients_at_accumulator(self) -> None:
        """What ZeRO-3's backward epilogue does: a rank that ran no backward never did it."""
        for sub_group_id, sub_group in enumerate(self.fp16_groups):
            self.averaged_gradients[sub_group_id] = windows.accumulator_views(self, sub_group)

    def _odc_squared_norms(self) -> torch.Tensor:
        """Per sub-group, the squared L2 norm of this owner's gradient shards as ``get_grad_norm_direct``
        sums them (float64, on the host)."""
        squares = []
        for sub_group in self.fp16_groups:
            norms = [g.to(_norm_dtype()).norm(2) for g in windows.accumulator_views(self, sub_group)]
            squares.append(torch.sum(torch.pow(torch.stack(norms), 2)) if norms
                           else torch.zeros((), dtype=torch.float64))
        return torch.stack(squares).to(torch.float64).cpu()

    def _odc_stage_offload_grads(self) -> None:
        """Optimizer offload: ZeRO-3's step (and its gradient reads) use each sub-group's host fp32
        gradient buffer, which ZeRO-3 fills from its partitions at the boundary. On ODC the
        partitions are the accumulator, so copy it there (a device-to-host copy on GPU, once per step)."""
        if not self.offload_optimizer:
            return
        views = getattr(self, windows.GRAD_PARTITIONS)
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
            getattr(self, windows.GRAD_PARTITIONS)[param.ds_id].copy_(
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

    def get_fp32_grad_partitions(self):
        """ZeRO-3's, after a gradient fence (collective on ODC)."""
        self._odc_fence_for_read("optimizer.get_fp32_grad_partitions()")
        return super().get_fp32_grad_partitions()

    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        self._odc_fence_for_read("reading or writing a gradient partition (safe_get/set_*_grad)")
        return super()._get_fp32_grad_state_partition(param, release_swap_buffers)

    # -- the step: ZeRO-3's re-entered, and every override it calls -------------------------------------
    @contextlib.contextmanager
    def step_context(self):
        """The :class:`StepContext` of the step in progress, opened here unless one is open already (the
        engine opens it around its whole model step; a direct ``optimizer.step()`` gets its own)."""
        if self.odc_step is not None:
            yield self.odc_step
            return
        self.odc_step = StepContext()
        try:
            yield self.odc_step
        finally:
            self.odc_step = None

    def step(self, closure=None):
        """The boundary step: the runtime's step protocol (its update re-enters ZeRO-3's step), then the
        persistent-parameter refresh."""
        with self.step_context() as context:
            context.totals = self.odc.step(_Zero3Update(self, context))
            self._pull_released_persistent_params()

    def _get_norm_groups(self):
        """Inside a step, the norm round's per-sub-group norms (no collective); between backward and
        step, the same norms of the gradients so far, behind a gradient fence and a norm round
        (collective, as ZeRO-3's all-reduce is). ZeRO-3's -1 for inf/nan either way."""
        norms = self.odc_step.norms if self.odc_step is not None else None
        if norms is None:
            what = "optimizer._get_norm_groups() between backward and step"
            self._odc_fence_for_read(what)
            norms = self.odc.gradient_norms(self._odc_squared_norms(), what)
        sentinel = torch.tensor(-1.0, dtype=torch.float)
        # the dtype ZeRO-3's own norms have: its offload path computes them in fp32
        dtype = torch.float32 if self.offload_optimizer else _norm_dtype()
        return [torch.where(n.isinf() | n.isnan(), sentinel, n).to(self.device, dtype) for n in norms.group_norms()]

    def has_overflow(self, partition_gradients=True):
        """Inside an ODC step: whether any rank's gradient is not finite (the norm round's result,
        the same on every rank). ZeRO-3's check would all-reduce a flag read from this owner's shard."""
        norms = self.odc_step.norms if self.odc_step is not None else None
        if norms is None:
            return super().has_overflow(partition_gradients)
        return not norms.finite

    def zero_grad(self, set_to_none=True):
        """Inside an engine step, ZeRO-3's (the accumulators are cleared by the step itself). Outside one,
        called by every rank as ZeRO-3 expects, it drops every rank's gradients since the last step
        (ZeRO-3's next backward overwrites its partitions): a collective discard."""
        if self.odc_step is None and self._odc_between_steps():
            self.odc.discard_gradients("optimizer.zero_grad() outside a step")
        return super().zero_grad(set_to_none=set_to_none)

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

    # -- offload_states / reload_states: two of ZeRO-3's states are ODC windows --------------------------
    def offload_states(self, include=None, device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=False):
        """ZeRO-3's for the states that are this rank's own (fp32 master weights, optimizer states, the
        gradient bucket); the two that are windows peers reach, ``lp_params`` (the parameter window) and
        ``lp_grads`` (the accumulator), move with every rank (collective, :mod:`ds_odc.runtime.residency`)
        and ZeRO-3's buffers point at their host copies. ZeRO-3's own checks run before anything moves."""
        self.odc.refuse_with_global_sharding("engine.offload_states()")  # before anything moves
        wanted = list(OffloadStateTypeEnum) if include is None else list(include)
        own = [state for state in wanted if state not in WINDOW_STATES]
        super().offload_states(include=own, device=device, pin_memory=pin_memory, non_blocking=non_blocking)
        moved = self.odc.offload_windows({WINDOW_STATES[s] for s in wanted if s in WINDOW_STATES}, pin_memory,
                                         non_blocking)
        self._odc_bind_windows(moved)

    def reload_states(self, non_blocking: bool = False):
        """ZeRO-3's for this rank's own states, then the windows back on the device, every rank's mapped
        (collective; a rank that cannot allocate them makes every rank raise, with the windows still away)."""
        super().reload_states(non_blocking=non_blocking)
        self._odc_bind_windows(self.odc.reload_windows(non_blocking))

    def _odc_bind_windows(self, kinds) -> None:
        """ZeRO-3's buffers pointed at the windows of ``kinds`` where the runtime has them now."""
        if "params" in kinds:
            windows.bind_param_window(self, self.odc)
        if "grads" in kinds:
            windows.adopt_accumulator(self, self.odc)

    # -- checkpoints and teardown ------------------------------------------------------------------
    def odc_republish(self) -> None:
        """After a checkpoint load rewrote the shards: drop stale full copies, let every owner
        finish writing, then refresh persistent parameters. Called by ``ODCEngine.load_checkpoint``."""
        self._partition_all_parameters()
        self.odc.windows_rewritten("re-publishing shards after load_checkpoint")
        self._pull_released_persistent_params()

    def destroy(self):
        """Release windows and hooks; the model's parameters go back to ZeRO-3's collective gathers,
        their shards copied out of the windows into private memory."""
        for hook in self._odc_hooks:
            hook.remove()
        try:
            super().destroy()
        finally:
            self._release_odc()

    def _release_odc(self) -> None:
        uninstall_pulls(windows.partitioned_params(self))
        offload = getattr(self, "parameter_offload", None)
        if offload is not None:
            restore_trace_checks(offload.get_param_coordinator())
        if self._odc_runtime is None:
            return
        windows.release_windows(self)
        self._odc_runtime.close()
