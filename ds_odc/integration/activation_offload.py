"""The engine's side of activation offload (``zero_optimization.odc.activation_offload``): one object per
engine that decides, at each training forward, what the micro-batch offloads, and runs its hooks.

What only the adapter knows lives here: where ZeRO-3 keeps a parameter (its gathered ``param.data`` and its
shard ``param.ds_tensor``, never offloaded: [Note: what is never offloaded] in
:mod:`ds_odc.activations.hooks`), which frames are torch's reentrant checkpoint saving its inputs (mode
``"checkpoint_inputs"``), and how many tokens a forward's inputs hold.

The micro-batch's token count: set ahead by the caller that planned it (:meth:`EngineOffload.plan_next`,
what a balanced Trainer slot does with its plan's tokens), else read from the inputs: ``input_ids`` (its
number of elements), else the first tensor argument (integer: its elements; floating: its rows, all
dimensions but the last). The profile is calibrated on the first training micro-batch
(:mod:`ds_odc.activations.calibrate`) and logged, then follows the longest micro-batch that offloaded (what
its hooks observed), so sizes that grow faster than tokens are estimated from the long micro-batches. The step
protocol is untouched: nothing here communicates.
"""
from __future__ import annotations

import collections
import contextlib
import sys
from types import FrameType
from typing import Callable, Optional

import torch
import torch.utils.checkpoint as torch_checkpoint
from deepspeed.utils import logger

from ds_odc.activations import (
    HostPool,
    MicroBatchOffload,
    MicroBatchStats,
    SavedProfile,
    decide,
    measure_copy_rate,
    measure_profile,
    tokens_that_fit,
)
from ds_odc.activations.policy import MIB
from ds_odc.config import ActivationOffloadConfig

#: Micro-batches whose statistics are kept (``EngineOffload.history``).
HISTORY = 4096


def tokens_of(inputs: tuple, kwargs: dict) -> Optional[int]:
    """A forward's token count as the module docstring says, or None without a tensor argument.

    >>> tokens_of((), {"input_ids": torch.zeros(2, 5, dtype=torch.long)})
    10
    >>> tokens_of((torch.zeros(4, 3, 7),), {})
    12
    """
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    for value in (*inputs, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.dim() >= 2:
                return value.numel() // value.shape[-1]
            return value.numel()
    return None


def inside_reentrant_checkpoint_save() -> bool:
    """True when called (from a pack hook) while torch's reentrant ``CheckpointFunction`` saves its inputs."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "apply":
            cls = frame.f_locals.get("cls")
            if isinstance(cls, type) and issubclass(cls, torch_checkpoint.CheckpointFunction):
                return True
        frame = frame.f_back
    return False


class EngineOffload:
    """One engine's activation offload: the options, the calibrated profile, the pool, the live micro-batches."""

    def __init__(self, options: ActivationOffloadConfig, module: torch.nn.Module, device):
        self.options, self.device = options, torch.device(device)
        self.budget_bytes = options.budget_mb * MIB
        self.pool = HostPool(pin=self.device.type == "cuda")
        self.profile: Optional[SavedProfile] = None
        self.profile_tokens = 0  # the micro-batch the profile was measured on (the longest that offloaded)
        self.copy_rate: Optional[float] = None  # bytes per second, measured with the profile
        self.history: collections.deque[MicroBatchStats] = collections.deque(maxlen=HISTORY)
        self._parameters = list(module.parameters())
        self._streams = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)) \
            if self.device.type == "cuda" else None
        self._live: list[MicroBatchOffload] = []
        self._next_tokens: Optional[int] = None
        self._warned_no_tokens = False

    # -- what is offloaded -----------------------------------------------------------------------------
    def is_parameter(self, tensor: torch.Tensor) -> bool:
        """A parameter, a view of one, or any tensor on a parameter's (gathered) storage or its shard's. An
        operation's own output (not a view: a view's ``_base`` is its root) owns fresh storage, so only leaves
        and detached tensors are compared with every parameter's storage (per save, that would cost O(params))."""
        root = tensor._base if tensor._base is not None else tensor
        if isinstance(root, torch.nn.Parameter):
            return True
        if root.grad_fn is not None:
            return False
        address = tensor.untyped_storage().data_ptr()
        for param in self._parameters:
            if param.data.untyped_storage().data_ptr() == address:
                return True
            shard = getattr(param, "ds_tensor", None)
            if shard is not None and shard.untyped_storage().data_ptr() == address:
                return True
        return False

    def eligible(self, tensor: torch.Tensor) -> bool:
        return self.options.mode == "all" or inside_reentrant_checkpoint_save()

    # -- the engine's hooks ----------------------------------------------------------------------------
    def plan_next(self, tokens: int) -> None:
        """The next training forward's token count, as its planner counted it."""
        self._next_tokens = int(tokens)

    @contextlib.contextmanager
    def forward(self, run_forward: Callable[[], object], inputs: tuple, kwargs: dict, training: bool):
        """Around the engine's forward: decide, then run it under the micro-batch's hooks (or none)."""
        tokens, self._next_tokens = self._next_tokens, None
        if not (training and torch.is_grad_enabled()):
            yield
            return
        tokens = tokens if tokens is not None else tokens_of(inputs, kwargs)
        if not tokens:
            if not self._warned_no_tokens:
                self._warned_no_tokens = True
                logger.warning("ds_odc activation offload: a forward without a tensor argument or tokens; it is not "
                               "offloaded (engine.odc_plan_activation_offload(tokens) names its token count)")
            yield
            return
        profile = self.profile if self.profile is not None else self._calibrate(run_forward, tokens)
        decision = decide(tokens, profile, self.budget_bytes)
        if not decision.offloads:
            self.history.append(MicroBatchStats(tokens, 0, 0))
            yield
            return
        lease = self.pool.reserve(decision.offload_bytes)
        micro_batch = MicroBatchOffload(decision, lease, self.device, self.is_parameter, self.eligible, self._streams)
        self._live.append(micro_batch)
        self.history.append(micro_batch.stats)
        with micro_batch.hooks():
            yield

    def before_backward(self) -> None:
        """Ahead of a backward: start bringing back the newest offloaded storages."""
        if self._live:
            self._live[-1].prefetch()

    def after_backward(self, retain_graph: bool = False) -> None:
        """The micro-batches this backward unpacked give their host slices back (kept for a second backward
        with ``retain_graph``; one whose graph was not backwarded waits for the step)."""
        if retain_graph:
            return
        done = [mb for mb in self._live if mb.stats.returned_bytes > 0 or mb.stats.moved_tensors == 0]
        for micro_batch in done:
            self._finish(micro_batch)
        self._live = [mb for mb in self._live if mb not in done]

    def at_step(self) -> None:
        """At the optimizer step every graph of the step has been backwarded or dropped."""
        for micro_batch in self._live:
            self._finish(micro_batch)
        self._live = []

    def _finish(self, micro_batch: MicroBatchOffload) -> None:
        """Release its host slices; a micro-batch longer than the profile's becomes the profile (saved sizes
        that grow faster than tokens, e.g. eager attention's s², are then estimated from the long ones)."""
        micro_batch.finish()
        tokens = micro_batch.stats.tokens
        if tokens > self.profile_tokens and micro_batch.observed:
            self.profile = SavedProfile(tuple(size / tokens for size in micro_batch.observed),
                                        micro_batch.observed_kept / tokens)
            self.profile_tokens = tokens

    def _calibrate(self, run_forward, tokens: int) -> SavedProfile:
        self.profile = measure_profile(run_forward, tokens, self.device, self.is_parameter, self.eligible)
        self.profile_tokens = tokens
        self.copy_rate = measure_copy_rate(self.device, self.pool.pin)
        fit = tokens_that_fit(self.profile, self.budget_bytes, offload=False)
        fit_offloaded = tokens_that_fit(self.profile, self.budget_bytes)
        logger.info(
            f"ds_odc activation offload: calibrated on a micro-batch of {tokens} tokens: "
            f"{self.profile.bytes_per_token:.1f} saved bytes per token ({len(self.profile.offloadable)} offloadable "
            f"storages, {self.profile.kept:.1f} bytes per token that stay, mode {self.options.mode!r}); host copy "
            f"{self.copy_rate / 1e9:.2f} GB/s; budget {self.options.budget_mb} MiB holds {fit} tokens without "
            f"offload, {'any number' if fit_offloaded is None else fit_offloaded} with it")
        if not self.profile.offloadable:
            logger.warning(f"ds_odc activation offload: mode {self.options.mode!r} finds no saved tensor to offload in "
                           "this model (\"checkpoint_inputs\" needs torch's reentrant activation checkpointing)")
        return self.profile


def offload_aware_cost(trainer, cost_model, measured: bool):
    """LB-Mini's cost model for a balanced Trainer whose engine offloads activations: the measured model (in
    seconds) plus the transfer it cannot hide (:class:`~ds_odc.balance.cost.OffloadAwareCost`), from the
    calibrated bytes per token and copy rate averaged over ranks (one gather, so every rank plans alike).
    A cost model not in seconds ("tokens", a given formula) cannot add seconds: it is returned as it is."""
    from ds_odc.balance.cost import OffloadAwareCost, OffloadTransfer
    from ds_odc.integration.hf_gather import gather_rows

    wrapped = getattr(trainer.accelerator, "deepspeed_engine_wrapped", None)
    offload = getattr(getattr(wrapped, "engine", None), "odc_activation_offload", None)
    if offload is None:
        return cost_model
    if not measured or offload.profile is None:
        if trainer.is_world_process_zero():
            logger.info("ds_odc activation offload: the balance plan does not price the offload transfer (only "
                        "\"cost_model\": \"measure\" is in seconds)")
        return cost_model
    row = torch.tensor([offload.profile.bytes_per_token, offload.copy_rate], dtype=torch.float64)
    bytes_per_token, rate = gather_rows(trainer, row, "activation-offload profile").mean(dim=0).tolist()
    return OffloadAwareCost.around(cost_model, OffloadTransfer(bytes_per_token, offload.budget_bytes, rate))
