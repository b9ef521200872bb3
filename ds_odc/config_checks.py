"""What an "odc" ds_config may not combine, judged on the whole ds_config at parse time
(:func:`check_compatibility`, called by :func:`ds_odc.config.canonicalize`): ZeRO options the odc stage cannot
honour yet, fp16, tensor and DeepSpeed's sequence parallelism, settings activation offload cannot compose with,
and bf16 accumulators under a config that leaves bf16 off. Apart from :mod:`ds_odc.config` so that module
keeps to the options themselves and the routing of a ds_config to its canonical form.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ds_odc.errors import ODCConfigError

if TYPE_CHECKING:
    from ds_odc.config import ODCConfig

__all__ = ["ENV_EXPERIMENTAL_FP16", "UNSUPPORTED_ZERO_OPTIONS", "check_compatibility"]

#: ``=1`` lets fp16 through the odc stage's refusal. Experimental: fp16 has never run on ODC (DeepSpeed has no
#: fp16 on CPU, and no GPU run has validated it yet); the GPU kit's ``fp16`` item sets it to compare against
#: ZeRO-3's fp16 with an overflow step (docs/gpu.md). The refusal goes once that item passes.
ENV_EXPERIMENTAL_FP16 = "DS_ODC_EXPERIMENTAL_FP16"


#: ZeRO options ODC cannot honour yet: (path in zero_optimization, predicate of "in use", why).
UNSUPPORTED_ZERO_OPTIONS = (
    ("offload_param", lambda v: isinstance(v, dict) and v.get("device") == "nvme",
     "parameter offload to NVMe is not supported with the odc stage (\"device\": \"cpu\" is)"),
    ("offload_optimizer", lambda v: isinstance(v, dict) and v.get("device") == "nvme",
     "optimizer offload to NVMe is not supported with the odc stage (\"device\": \"cpu\" is)"),
    ("zero_hpz_partition_size", lambda v: v not in (None, 1), "hpZ secondary partitions are not supported"),
    ("zero_quantized_weights", bool, "quantized weights are not supported"),
    ("zero_quantized_nontrainable_weights", bool, "quantized weights are not supported"),
    ("mics_shard_size", lambda v: v not in (None, -1, 0), "MiCS is not supported with the odc stage"),
)


def check_compatibility(ds_config: dict, options: "ODCConfig", asked_by: str = "") -> None:
    """The one place for cross-field checks of an "odc" ds_config. ``asked_by``: what asked for ODC, when it
    was not the config itself (the environment switch), added to every refusal."""
    try:
        _check_combinations(ds_config)
        _check_activation_offload(ds_config, options)
        if not asked_by:  # the switch's options reach every stage-3 engine, frozen ones too: initialize judges
            _check_bf16_accumulators(ds_config, options)
    except ODCConfigError as err:
        if not asked_by:
            raise
        raise ODCConfigError(f"{err} ({asked_by} asked for the odc stage for this stage-3 config)") from None


def _check_combinations(ds_config: dict) -> None:
    zero = ds_config["zero_optimization"]
    for key, in_use, why in UNSUPPORTED_ZERO_OPTIONS:
        if key in zero and zero[key] != "auto" and in_use(zero[key]):
            raise ODCConfigError(f"zero_optimization.{key}={zero[key]!r}: {why}; remove it or use stage 3")
    fp16 = ds_config.get("fp16", {})
    if (isinstance(fp16, dict) and fp16.get("enabled") not in (False, None, "auto")
            and os.environ.get(ENV_EXPERIMENTAL_FP16) != "1"):
        raise ODCConfigError(f"fp16.enabled={fp16.get('enabled')!r}: the odc stage supports fp32 and bf16 only; "
                             "use bf16")
    tensor_parallel = ds_config.get("tensor_parallel") or {}
    if not isinstance(tensor_parallel, dict):
        raise ODCConfigError(f"tensor_parallel={tensor_parallel!r}: give it as a dict of tensor-parallel options "
                             '(e.g. {"autotp_size": 1}) or remove it')
    autotp = tensor_parallel.get("autotp_size", 0)
    if isinstance(autotp, int) and autotp > 1:
        raise ODCConfigError(f"tensor_parallel.autotp_size={autotp}: tensor parallelism is not supported with the "
                             "odc stage yet (every rank must be a data-parallel rank); leave autotp_size out or use "
                             "stage 3")
    sequence = ds_config.get("sequence_parallel_size", 1)
    if isinstance(sequence, int) and sequence > 1:
        raise ODCConfigError(f"sequence_parallel_size={sequence}: DeepSpeed's device-mesh route to sequence "
                             "parallelism partitions ZeRO-3 over the data-parallel mesh only and is not supported on "
                             "the odc stage; use ALST's route instead (the mpu from UlyssesSPAttentionHF."
                             "register_with_transformers(...) passed to deepspeed.initialize, or accelerate's "
                             'ParallelismConfig(sp_size=N, sp_backend="deepspeed")) and leave '
                             "sequence_parallel_size out")


#: Settings activation offload cannot compose with: (path, predicate of "in use", why).
_OFFLOAD_CONFLICTS = (
    ("activation_checkpointing.cpu_checkpointing", bool,
     "DeepSpeed's CPU checkpointing already moves checkpoint inputs to the host; use activation_offload's "
     "\"mode\": \"checkpoint_inputs\" instead"),
    ("compile.deepcompile", bool, "DeepCompile traces the forward; saved-tensor hooks do not reach its graph"),
)


def _check_activation_offload(ds_config: dict, options: "ODCConfig") -> None:
    """Activation offload refuses, by name, the settings it cannot compose with (only when it is on)."""
    if options.activation_offload is None:
        return
    for path, in_use, why in _OFFLOAD_CONFLICTS:
        section, key = path.split(".")
        block = ds_config.get(section)
        value = block.get(key) if isinstance(block, dict) else None
        if value not in (None, "auto") and in_use(value):
            raise ODCConfigError(f"{path}={value!r} with zero_optimization.odc.activation_offload: {why}; "
                                 "remove one of the two")


def _check_bf16_accumulators(ds_config: dict, options: "ODCConfig") -> None:
    """bf16 accumulators hold what ZeRO-3 holds for a bf16 model only: refused where the ds_config leaves bf16
    off, in the words initialize uses for a model that computes in another dtype
    (``ds_odc.integration.zero3_windows.accumulator_dtype``, which stays for configs built other ways)."""
    bf16 = ds_config.get("bf16")
    bf16 = ds_config.get("bfloat16", {}) if bf16 is None else bf16  # DeepSpeed's older name
    if options.accumulator_dtype == "bf16" and isinstance(bf16, dict) and bf16.get("enabled", False) in (False, None):
        raise ODCConfigError("zero_optimization.odc.accumulator_dtype='bf16' needs a bf16 model (the ds_config's "
                             "bf16.enabled: true); this one leaves bf16 off. Leave accumulator_dtype out (fp32) for "
                             "it, or set bf16.enabled true")


