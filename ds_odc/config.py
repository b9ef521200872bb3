"""The "odc" stage in a ds_config, and its options: :class:`ODCConfig` (the fields of ``zero_optimization.odc``
and their cross-field checks) and the routing of a ds_config that asks for the stage to its canonical form.
The option blocks nested in ODCConfig (``balance``, ``activation_offload``, ``timeline``) are in
:mod:`ds_odc.config_options`, re-exported here.

Three ways to ask for it, all ending in the same canonical form:

* the stage value: ``"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 30}, ...}``;
* the marker form, for frameworks that compare the stage with 3 themselves (every ``stage == 3`` check
  keeps seeing 3): ``"zero_optimization": {"stage": 3, "odc": {"timeout_s": 30}, ...}``;
* the environment switch, for configs built in code where no ds_config key can be reached:
  ``DS_ODC_STAGE3=odc`` (options as JSON in ``DS_ODC_OPTIONS``) makes every stage-3 config ask for ODC.

Canonical form, what DeepSpeed, transformers and accelerate see after :func:`canonicalize`::

    "zero_optimization": {"stage": 3, ...},  "odc": {"transport": "auto", "timeout_s": 30.0, ...}

Every ``stage`` comparison in those libraries keeps working with the int 3, and DeepSpeed ignores
unknown top-level keys, so the marker travels with the dict (including into checkpoints).
"""
from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# the nested option blocks, re-exported: ``from ds_odc.config import BalanceConfig`` keeps working
from ds_odc.config_options import ActivationOffloadConfig, BalanceConfig, QuadraticCost, TimelineConfig
from ds_odc.errors import ODCConfigError
from ds_odc_import_hooks import ODC, STAGE3_SWITCH, SWITCH_OFF

__all__ = ["ENV_EXPERIMENTAL_FP16", "ENV_OPTIONS", "ENV_SWITCH", "MARKER_KEY", "ODC_STAGE", "ActivationOffloadConfig",
           "BalanceConfig", "ODCConfig", "QuadraticCost", "TimelineConfig", "canonicalize", "env_switch",
           "is_odc_config", "parse_options", "stage_three"]

ODC_STAGE = ODC
MARKER_KEY = ODC
ENV_SWITCH = STAGE3_SWITCH
ENV_OPTIONS = "DS_ODC_OPTIONS"
#: ``=1`` lets fp16 through the odc stage's refusal. Experimental: fp16 has never run on ODC (DeepSpeed has no
#: fp16 on CPU, and no GPU run has validated it yet); the GPU kit's ``fp16`` item sets it to compare against
#: ZeRO-3's fp16 with an overflow step (docs/gpu.md). The refusal goes once that item passes.
ENV_EXPERIMENTAL_FP16 = "DS_ODC_EXPERIMENTAL_FP16"


class ODCConfig(BaseModel):
    """Options of the "odc" stage: written under ``zero_optimization.odc`` in the ds_config, moved to the
    top-level ``"odc"`` block by :func:`canonicalize`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)  # strict: "5" or true is not 5.0

    transport: Literal["auto", "shm", "cuda_ipc"] = "auto"
    """Where shards live. "auto" picks by device ("shm" for CPU tensors, "cuda_ipc" for CUDA
    tensors). "shm": shared-memory windows, all ranks on one host. "cuda_ipc": GPU-memory windows
    mapped by CUDA IPC, all ranks on one node, GPUs joined by NVLink (or ranks sharing one GPU);
    its CUDA operator is JIT-built with ninja on first use. A transport that does not serve the
    model's device fails at initialize. Default "auto"."""

    timeout_s: Optional[Annotated[float, Field(ge=0.1, le=86400)]] = None
    """How long a rank waits on a peer that makes no progress (no forward, pull or push; or a stripe
    lock held) before raising an error that names the peer and what it was last doing. A peer still
    computing is waited for; a dead or failed one is reported at once. Default null: the process
    group's own timeout, the bound DeepSpeed uses for a silent peer (``deepspeed.init_distributed(timeout=...)``,
    10 minutes unless ``DEEPSPEED_TIMEOUT`` says otherwise). Must be in [0.1, 86400]: liveness is checked
    every 50 ms, so a shorter bound would mistake a healthy peer for a stuck one."""

    shm_dir: str = "/dev/shm"
    """tmpfs directory for the shm transport's segments (unlinked right after start-up).
    Default "/dev/shm"; must be an existing directory."""

    accumulator_stripe_numel: int = Field(1 << 20, ge=1024)
    """Elements per lock stripe of a gradient accumulator: concurrent pushes into different stripes
    of one owner proceed in parallel. Default 1048576 (4 MiB of fp32); at least 1024."""

    accumulator_dtype: Literal["fp32", "fp64", "bf16"] = "fp32"
    """Precision of the owners' gradient accumulators. "fp32" (default): pushes from several ranks
    are summed in arrival order, so results may differ run to run in the last bits (as any change of
    summation order does). "fp64": 4 more bytes per shard element; its sums are exact while the values
    summed into one element span less than about 2**29 in magnitude, so runs usually repeat bit for bit,
    but that is not guaranteed (``deterministic`` is). "bf16": 2 bytes per shard element, what ZeRO-3 holds
    for a bf16 model by default (its ``grad_accum_dtype``; 16 bytes per parameter over the job with Adam and
    ``cross_node`` "global"); every push is rounded to bf16 as it is added, as ZeRO-3's bf16 reduce-scatter and
    accumulation round (docs/normalisation.md). bf16 models on CPU ranks only for now (refused otherwise by
    name)."""

    cross_node: Literal["replicate", "global", "budget", "auto"] = "replicate"
    """How a job on several nodes holds parameters and gradient accumulators (docs/multinode.md). "replicate"
    (default): the ranks of each node hold the whole model's parameter window and accumulator between them (per
    rank ``n_nodes`` times ZeRO-3's partitions); pulls and pushes stay in the node and nodes exchange once per
    step, the least cross-node traffic. "global": every rank holds only its own ``1/world`` of parameters and
    accumulators, ZeRO-3's memory; pulls and pushes reach owners on other nodes one-sided (about ``6P(N-1)/N``
    bytes per micro-batch per rank, bf16), and the step needs no gradient or parameter collective. "budget":
    global, except the first whole layers (forward order) whose replicated copies fit ``node_replica_budget_gb``
    (required), which are held and exchanged as with "replicate". "auto": "replicate" when its replicated part
    fits ``node_replica_budget_gb`` (or no budget is given), else "budget" when some layers fit, else "global",
    saying which and why in the log. On one node every value is the same (nothing crosses nodes). Values other
    than "replicate" run on CPU hosts for now (refused on GPUs by name)."""

    node_replica_budget_gb: Optional[Annotated[float, Field(gt=0)]] = None
    """With ``cross_node`` "budget" (required) or "auto": GiB per rank the replicated part of model states may take
    beyond global sharding's (node-local copies of other nodes' shards and accumulators of the replicated layers:
    ``(N-1)/W · ((c + a)·p_t + c·p_f)`` bytes per layer of ``p_t`` trainable and ``p_f`` frozen parameters, ``c``
    and ``a`` bytes per window and accumulator element). Refused with "replicate" or "global", which would ignore
    it. Default null (auto then replicates); more than 0."""

    deterministic: Optional[bool] = None
    """Sum gradients so that a run repeats bit for bit whatever order pushes arrive in (uneven counts, slow
    ranks, several nodes): each pushed value is cut into two parts on fixed grids and summed exactly in two
    fp64 regions, folded once per step (docs/normalisation.md). Costs 16 bytes of accumulator per shard
    element (fp32: 4) and two pushes per piece; values below about 1e-18 are rounded away. Gradients read
    before the step (``engine.allreduce_gradients()``, ``safe_get_full_grad``) are folded in their own copy, so
    backward may go on after them. Default null: on when ``torch.use_deterministic_algorithms(True)`` is set at
    initialize.
    ``accumulator_dtype`` cannot be given with it. CPU ranks only for now (refused on GPUs by name)."""

    loss_normalization: Literal["auto", "token"] = "auto"
    """How accumulated gradients are normalised at the step (docs/normalisation.md).
    "auto": follow DeepSpeed's rules (mean over the global micro-batches for ``engine.backward(loss)``
    in managed mode; the caller's own scaling averaged over ranks otherwise), switching to per-token
    for micro-batches that report ``loss_tokens``. "token": every backward must report its token
    count; the summed loss gradient is divided by the global token count. Default "auto"."""

    metrics: bool = True
    """Record each rank's step timeline (compute per micro-batch, pull, push, step wait, optimizer;
    docs/metrics.md), available as ``engine.odc_metrics``. Costs two clock reads per module
    fetch and per gradient bucket. Default true."""

    metrics_log_interval: int = Field(0, ge=0)
    """Log every rank's step report (one line, through DeepSpeed's logger at info level, so with the
    ds_config's ``"log_level": "info"``) every this many steps; 0 (default) never logs. With one of DeepSpeed's
    monitors on (the ds_config's tensorboard, wandb, comet or csv_monitor block), the ``ODC/...`` figures are
    written through it every this many steps, every step when 0 (docs/metrics.md)."""

    balance: Optional[BalanceConfig] = None
    """Plan the Hugging Face Trainer's micro-batches from the lengths of each step's samples
    (``{"policy": "lb-mini", "token_cap": 65536, "cost_model": "tokens"}``; its fields are balance.*, and
    docs/balancing.md says how it works). The Trainer then takes the same samples per step as without it, and each
    rank runs its share as its own number of micro-batches. Default null: the Trainer's own batches."""

    activation_offload: Optional[ActivationOffloadConfig] = None
    """Offload saved activations of the micro-batches that exceed a device budget to one host pool
    (``{"budget_mb": 2048, "mode": "all"}``; its fields are activation_offload.*, and
    docs/activation_offload.md says how it works). Default null: activations stay where autograd saves them."""

    timeline: Optional[TimelineConfig] = None
    """Write every rank's busy/idle spans of chosen steps as a Chrome / Perfetto trace
    (``{"path": "timeline.json", "steps": [10, 11]}``; its fields are timeline.*). Needs ``metrics``. Default
    null: no trace."""

    @field_validator("shm_dir")
    @classmethod
    def _shm_dir_exists(cls, value: str) -> str:
        if not os.path.isdir(value):
            raise ValueError(f"directory {value!r} does not exist")
        return value

    @model_validator(mode="after")
    def _fields_agree(self) -> "ODCConfig":
        """The cross-field checks (one place)."""
        if self.deterministic and "accumulator_dtype" in self.model_fields_set:
            raise ValueError(f"deterministic=true sums into its own accumulator (two fp64 regions): leave "
                             f"accumulator_dtype={self.accumulator_dtype!r} out")
        if self.node_replica_budget_gb is not None and self.cross_node not in ("budget", "auto"):
            raise ValueError(f"node_replica_budget_gb applies to cross_node 'budget' and 'auto', not "
                             f"{self.cross_node!r}: leave the budget out, or set cross_node 'budget' or 'auto'")
        if self.cross_node == "budget" and self.node_replica_budget_gb is None:
            raise ValueError("cross_node 'budget' needs node_replica_budget_gb (GiB per rank for the layers kept "
                             "node-local): set it, or choose 'auto', 'replicate' or 'global'")
        if self.timeline is not None and not self.metrics:
            raise ValueError("timeline draws the step recorder's spans, so metrics=false cannot go with it: leave "
                             "metrics out (it defaults to true) or the timeline")
        return self


#: ZeRO options ODC cannot honour yet: (path in zero_optimization, predicate of "in use", why).
_UNSUPPORTED_ZERO_OPTIONS = (
    ("offload_param", lambda v: isinstance(v, dict) and v.get("device") == "nvme",
     "parameter offload to NVMe is not supported with the odc stage (\"device\": \"cpu\" is)"),
    ("offload_optimizer", lambda v: isinstance(v, dict) and v.get("device") == "nvme",
     "optimizer offload to NVMe is not supported with the odc stage (\"device\": \"cpu\" is)"),
    ("zero_hpz_partition_size", lambda v: v not in (None, 1), "hpZ secondary partitions are not supported"),
    ("zero_quantized_weights", bool, "quantized weights are not supported"),
    ("zero_quantized_nontrainable_weights", bool, "quantized weights are not supported"),
    ("mics_shard_size", lambda v: v not in (None, -1, 0), "MiCS is not supported with the odc stage"),
)


def env_switch(environ: Mapping[str, str] = os.environ) -> Optional[dict]:
    """The options ``DS_ODC_STAGE3=odc`` asks for (the JSON object in ``DS_ODC_OPTIONS``, ``{}`` without
    it), or None when the switch is off (unset, empty, "0", "off", "false", "no"). Any other value, or
    options that are not a JSON object, raise naming the variable."""
    value = environ.get(ENV_SWITCH, "").strip()
    if value.lower() in SWITCH_OFF:
        return None
    if value.lower() != ODC_STAGE:
        raise ODCConfigError(f"{ENV_SWITCH}={value!r}: set it to \"odc\" (every ZeRO-3 engine of the job then runs on "
                             "the odc stage) or leave it unset")
    raw = environ.get(ENV_OPTIONS, "").strip()
    try:
        options = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise ODCConfigError(f"{ENV_OPTIONS}={raw!r} is not JSON ({err}); give the odc options as a JSON object, "
                             'e.g. {"timeout_s": 60}') from None
    if not isinstance(options, dict):
        raise ODCConfigError(f"{ENV_OPTIONS}={raw!r}: the odc options must be a JSON object, "
                             'e.g. {"timeout_s": 60}')
    return options


def _check_compatibility(ds_config: dict, asked_by: str = "") -> None:
    """The one place for cross-field checks of an "odc" ds_config. ``asked_by``: what asked for ODC, when it
    was not the config itself (the environment switch), added to every refusal."""
    try:
        _check_combinations(ds_config)
    except ODCConfigError as err:
        if not asked_by:
            raise
        raise ODCConfigError(f"{err} ({asked_by} asked for the odc stage for this stage-3 config)") from None


def _check_combinations(ds_config: dict) -> None:
    zero = ds_config["zero_optimization"]
    for key, in_use, why in _UNSUPPORTED_ZERO_OPTIONS:
        if key in zero and zero[key] != "auto" and in_use(zero[key]):
            raise ODCConfigError(f"zero_optimization.{key}={zero[key]!r}: {why}; remove it or use stage 3")
    fp16 = ds_config.get("fp16", {})
    if (isinstance(fp16, dict) and fp16.get("enabled") not in (False, None, "auto")
            and os.environ.get(ENV_EXPERIMENTAL_FP16) != "1"):
        raise ODCConfigError(f"fp16.enabled={fp16.get('enabled')!r}: the odc stage supports fp32 and bf16 only; "
                             "use bf16")
    tensor_parallel = ds_config.get("tensor_parallel") or {}
    if not isinstance(tensor_parallel, dict):
        raise ODCConfigError(f"tensor_parallel={tensor_parallel!r}: must be a dict of tensor-parallel options "
                             '(e.g. {"autotp_size": 1})')
    autotp = tensor_parallel.get("autotp_size", 0)
    if isinstance(autotp, int) and autotp > 1:
        raise ODCConfigError(f"tensor_parallel.autotp_size={autotp}: tensor parallelism is not supported with the "
                             "odc stage yet (every rank must be a data-parallel rank)")
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


def _check_activation_offload(ds_config: dict, options: ODCConfig) -> None:
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


def parse_options(options: Optional[dict]) -> ODCConfig:
    """Validate ODC options; raise ODCConfigError naming the field on any bad key or value."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ODCConfigError(f"zero_optimization.odc must be a dict of options, got {type(options).__name__}")
    if "enabled" in options:
        raise ODCConfigError(f"zero_optimization.odc.enabled={options['enabled']!r}: not an option; the stage value "
                             'switches ODC on and off ("stage": "odc" or "stage": 3)')
    try:
        return ODCConfig(**options)
    except ValidationError as err:
        problems = "; ".join(  # a cross-field check (ODCConfig._fields_agree) has no loc: the block itself
            f"{'.'.join(['zero_optimization.odc', *(str(p) for p in e['loc'])])}: {e['msg']} (got {e.get('input')!r})"
            for e in err.errors())
        raise ODCConfigError(problems) from None


def is_odc_config(ds_config: Any) -> bool:
    """True for a dict that asks for the odc stage by itself: ``"stage": "odc"``, the marker form (stage 3 and
    an odc block under ``zero_optimization``) or the canonical form (stage 3 and the top-level marker)."""
    if not isinstance(ds_config, dict):
        return False
    zero = ds_config.get("zero_optimization")
    if not isinstance(zero, dict):
        return False
    stage = zero.get("stage")
    return stage == ODC_STAGE or (stage in (3, "3") and (MARKER_KEY in ds_config or MARKER_KEY in zero))


def stage_three(ds_config: Any) -> bool:
    """True for a dict whose ZeRO stage is 3 (what the environment switch turns into the odc stage)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    return isinstance(zero, dict) and zero.get("stage") in (3, "3")


def _check_stage_value(ds_config: Any) -> None:
    """A misspelt stage, or ODC options next to another stage, fails naming the field (DeepSpeed's
    own messages list neither "odc" nor the reason)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    if not isinstance(zero, dict):
        return
    stage = zero.get("stage")
    # "auto" is accelerate's placeholder, filled in later with the plugin's stage
    if isinstance(stage, str) and stage not in (ODC_STAGE, "auto") and not stage.strip().isdigit():
        raise ODCConfigError(f"zero_optimization.stage={stage!r}: allowed values are 0, 1, 2, 3 and \"odc\"")
    if MARKER_KEY in zero and stage not in (ODC_STAGE, 3, "3"):
        raise ODCConfigError(f"zero_optimization.odc is set but zero_optimization.stage={stage!r}: the odc options "
                             'need "stage": "odc", or "stage": 3 (the marker form), or removing')
    if MARKER_KEY in ds_config and stage not in (3, "3", ODC_STAGE):
        raise ODCConfigError(f"odc options with zero_optimization.stage={stage!r}: the odc stage needs "
                             '"stage": "odc"')


def canonicalize(ds_config: dict) -> Optional[ODCConfig]:
    """Rewrite an "odc" ds_config *in place* to the canonical form and return its options.

    In place, because transformers and accelerate hold the same dict object and read the stage
    from it later. Idempotent. Returns None (and leaves the dict alone) for any other config.

    A stage-3 config asks for ODC also when the environment switch is on (:func:`env_switch`): its options
    then come from ``DS_ODC_OPTIONS``, and stage 3 stays 3.

    >>> cfg = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5}}}
    >>> canonicalize(cfg).timeout_s, cfg["zero_optimization"]["stage"], cfg["odc"]["timeout_s"]
    (5.0, 3, 5.0)
    >>> marker = {"zero_optimization": {"stage": 3, "odc": {"timeout_s": 5}}}
    >>> canonicalize(marker).timeout_s, marker["zero_optimization"], marker["odc"]["timeout_s"]
    (5.0, {'stage': 3}, 5.0)
    """
    _check_stage_value(ds_config)
    asked_by = ""
    if not is_odc_config(ds_config):
        switched = env_switch() if stage_three(ds_config) else None
        if switched is None:
            return None
        ds_config[MARKER_KEY] = dict(switched)
        asked_by = f"{ENV_SWITCH}=odc"
    zero = ds_config["zero_optimization"]
    if zero.get("stage") == ODC_STAGE:
        options = parse_options(zero.pop(MARKER_KEY, None))
        zero["stage"] = 3
    elif MARKER_KEY in zero:  # the marker form
        options = parse_options(zero.pop(MARKER_KEY))
    else:
        options = parse_options(ds_config.get(MARKER_KEY))
    _check_compatibility(ds_config, asked_by)
    _check_activation_offload(ds_config, options)
    # Defaults left out: accelerate treats every "auto" string in a ds_config as a placeholder it must
    # fill (and raises for keys it does not know), and "auto" is the default of two options.
    ds_config[MARKER_KEY] = options.model_dump(exclude_defaults=True)
    return options
