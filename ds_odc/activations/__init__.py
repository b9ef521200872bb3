"""Activation offload chosen per micro-batch (``zero_optimization.odc.activation_offload``).

DeepSpeed-agnostic: a policy (how much of a micro-batch to offload, from its tokens), one host pool, the
saved-tensor hooks that move the bytes, and the calibration that measures bytes per token. The engine's
thin hook lives in :mod:`ds_odc.integration.activation_offload`.
"""
from ds_odc.activations.calibrate import measure_copy_rate, measure_profile
from ds_odc.activations.hooks import MicroBatchOffload, MicroBatchStats, counting_hooks
from ds_odc.activations.policy import OffloadDecision, SavedProfile, decide, plan_offload, pool_bytes, tokens_that_fit
from ds_odc.activations.pool import HostPool, PoolStats

__all__ = ["HostPool", "MicroBatchOffload", "MicroBatchStats", "OffloadDecision", "PoolStats", "SavedProfile",
           "counting_hooks", "decide", "measure_copy_rate", "measure_profile", "plan_offload", "pool_bytes",
           "tokens_that_fit"]
