"""The "odc" stage in a ds_config, and its options: :class:`ODCConfig` (the fields of ``zero_optimization.odc``
and their cross-field checks) and the routing of a ds_config that asks for the stage to its canonical form.
The option blocks nested in ODCConfig (``balance``, ``activation_offload``, ``timeline``) are in
:mod:`ds_odc.config_options`, re-exported here; what an odc ds_config may not combine is judged in
:mod:`ds_odc.config_checks`, and how a refused option reads is written in :mod:`ds_odc.config_messages`.

Three ways to ask for it, all ending in the same canonical form:

* the stage value: ``"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 30}, ...}`` ("odc" in any case,
  blanks around it ignored, as :func:`ds_odc_import_hooks.is_odc_stage` reads every stage value);
* the marker form, for frameworks that compare the stage with 3 themselves (every ``stage == 3`` check
  keeps seeing 3): ``"zero_optimization": {"stage": 3, "odc": {"timeout_s": 30}, ...}``;
* the environment switch, for configs built in code where no ds_config key can be reached:
  ``DS_ODC_STAGE3=odc`` (options as JSON in ``DS_ODC_OPTIONS``) makes every stage-3 config ask for ODC.

Canonical form, what DeepSpeed, transformers and accelerate see after :func:`canonicalize`::

    "zero_optimization": {"stage": 3, ...},  "odc": {"transport": "auto", "timeout_s": 30.0, ...}

Every ``stage`` comparison in those libraries keeps working with the int 3, and DeepSpeed ignores
unknown top-level keys, so the marker travels with the dict (including into checkpoints).

The options are read by one function, :func:`requested_options`, for every caller: ``zero_optimization.odc``
and the top-level ``odc`` block (a saved canonical config copied back, or written by hand) are merged where
they agree and refused, naming both, where they differ; no option written in either is dropped.
"""
from __future__ import annotations

import json
import os
from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ds_odc import config_messages
from ds_odc.config_checks import ENV_EXPERIMENTAL_FP16, check_compatibility

# the nested option blocks, re-exported: ``from ds_odc.config import BalanceConfig`` keeps working
from ds_odc.config_options import ActivationOffloadConfig, BalanceConfig, QuadraticCost, TimelineConfig
from ds_odc.errors import ODCConfigError
from ds_odc_import_hooks import ODC, STAGE3_SWITCH, SWITCH_OFF, is_odc_stage

__all__ = ["ENV_EXPERIMENTAL_FP16", "ENV_OPTIONS", "ENV_SWITCH", "MARKER_KEY", "ODC_STAGE", "ActivationOffloadConfig",
           "BalanceConfig", "ODCConfig", "QuadraticCost", "TimelineConfig", "canonicalize", "env_switch",
           "env_options", "is_odc_config", "parse_options", "requested_options", "stage_three"]

ODC_STAGE = ODC
MARKER_KEY = ODC
ENV_SWITCH = STAGE3_SWITCH
ENV_OPTIONS = "DS_ODC_OPTIONS"
#: Where the options may be written: the stage's own block (where users write them) and the top-level one
#: (the canonical form's; a saved canonical config copied back). :func:`requested_options` merges the two.
STAGE_BLOCK, TOP_BLOCK = f"zero_optimization.{ODC}", ODC


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
    saying which and why in the log. On one node every value is the same (nothing crosses nodes). "global" and
    "budget" across nodes run on CPU hosts for now (refused on GPUs by name); on GPUs "auto" is "replicate"."""

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
            raise ValueError(f"directory {value!r} does not exist; give an existing tmpfs directory, or leave shm_dir "
                             "out (default /dev/shm)")
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


def env_switch(environ: Mapping[str, str] = os.environ) -> Optional[dict]:
    """The options ``DS_ODC_STAGE3=odc`` asks for (the JSON object in ``DS_ODC_OPTIONS``, ``{}`` without
    it), or None when the switch is off (unset, empty, "0", "off", "false", "no"). Any other value, or
    options that are not a JSON object, raise naming the variable."""
    value = environ.get(ENV_SWITCH, "").strip()
    if value.lower() in SWITCH_OFF:
        return None
    if not is_odc_stage(value):
        raise ODCConfigError(f"{ENV_SWITCH}={value!r}: set it to \"odc\" (every ZeRO-3 engine of the job then runs on "
                             "the odc stage) or leave it unset")
    return env_options(environ)


def env_options(environ: Mapping[str, str] = os.environ) -> dict:
    """The JSON object in ``DS_ODC_OPTIONS`` (``{}`` when unset or empty), refused by name unless it is one. The
    switch's options; with a config that asks for the odc stage by itself, merged into its blocks
    (:func:`requested_options`)."""
    raw = environ.get(ENV_OPTIONS, "").strip()
    try:
        options = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise ODCConfigError(f"{ENV_OPTIONS}={raw!r} is not JSON ({err}); give the odc options as a JSON object, "
                             'e.g. {"timeout_s": 60}') from None
    if not isinstance(options, dict):
        raise ODCConfigError(f"{ENV_OPTIONS}={raw!r} is not a JSON object; give the odc options as one, "
                             'e.g. {"timeout_s": 60}')
    return options


def _options_block(path: str, options: Any) -> dict:
    """An options block as written (null: no options), refused by name unless it is a dict."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ODCConfigError(f"{path} must be a dict of options, got {type(options).__name__}: give it as a JSON "
                             'object (e.g. {"timeout_s": 60}) or remove it')
    return options


def parse_options(options: Optional[dict], block: str = STAGE_BLOCK,
                  path_of: Optional[Mapping[str, str]] = None) -> ODCConfig:
    """Validate ODC options; raise ODCConfigError naming each bad key or value by its dotted path (``block``, or
    ``path_of[key]`` for a key written elsewhere) and what to do, one line per problem."""
    options = _options_block(block, options)
    path_of = path_of or {}
    if "enabled" in options:
        raise ODCConfigError(f"{path_of.get('enabled', block)}.enabled={options['enabled']!r}: not an option; the "
                             'stage value switches ODC on and off ("stage": "odc" or "stage": 3): remove it')
    try:
        return ODCConfig(**options)
    except ValidationError as err:
        blocks = set(path_of.get(key, block) for key in options)
        where = blocks.pop() if len(blocks) == 1 else block  # a cross-field check names the block it read
        raise ODCConfigError("\n".join(config_messages.problems(err, ODCConfig, path_of, where))) from None


def _agree(key: str, first: Any, second: Any) -> bool:
    """Whether two blocks give one option the same value: equal as written (a bool is not a number), or
    parsed to the same value (5 and 5.0; a nested block with and without its defaults)."""
    if isinstance(first, dict) and isinstance(second, dict) and first.keys() == second.keys():
        if all(_agree(inner, first[inner], second[inner]) for inner in first):
            return True
    elif isinstance(first, bool) == isinstance(second, bool) and first == second:
        return True
    try:
        return getattr(ODCConfig(**{key: first}), key) == getattr(ODCConfig(**{key: second}), key)
    except (ValidationError, TypeError):
        return False


def requested_options(ds_config: Any) -> Optional[ODCConfig]:
    """The options a ds_config asks for, parsed, or None when it does not ask for the odc stage by itself
    (:func:`is_odc_config`). The one reader for every caller (:func:`canonicalize`, the Trainer's binding), so
    no option is read in one place and dropped in another: ``zero_optimization.odc``, the top-level ``odc`` block
    and ``DS_ODC_OPTIONS`` are merged (keys in one only are taken), refused by name where two give a key different
    values.

    >>> both = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5}}, "odc": {"metrics": False}}
    >>> requested_options(both).timeout_s, requested_options(both).metrics
    (5.0, False)
    >>> requested_options({**both, "odc": {"timeout_s": 7}})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ds_odc.errors.ODCConfigError: the odc options differ between zero_optimization.odc.timeout_s=5 and odc.timeout_s=...
    """
    if not is_odc_config(ds_config):
        return None
    merged: dict = {}
    path_of: dict = {}
    differ = []
    for path, block in ((STAGE_BLOCK, ds_config["zero_optimization"].get(MARKER_KEY)),
                        (TOP_BLOCK, ds_config.get(MARKER_KEY)), (ENV_OPTIONS, env_options())):
        for key, value in _options_block(path, block).items():
            if key not in merged:
                merged[key], path_of[key] = value, path
            elif not _agree(key, merged[key], value):
                differ.append(f"{path_of[key]}.{key}={merged[key]!r} and {path}.{key}={value!r}")
    if differ:
        raise ODCConfigError(f"the odc options differ between {'; between '.join(differ)}: {STAGE_BLOCK}, the "
                             f"top-level {TOP_BLOCK} block (the canonical form ds_odc writes) and {ENV_OPTIONS} are "
                             "merged only where they agree; give each option in one of them, or the same value in each")
    return parse_options(merged, STAGE_BLOCK, path_of)


def is_odc_config(ds_config: Any) -> bool:
    """True for a dict that asks for the odc stage by itself: ``"stage": "odc"``, the marker form (stage 3 and
    an odc block under ``zero_optimization``) or the canonical form (stage 3 and the top-level marker)."""
    if not isinstance(ds_config, dict):
        return False
    zero = ds_config.get("zero_optimization")
    if not isinstance(zero, dict):
        return False
    stage = zero.get("stage")
    return is_odc_stage(stage) or (stage in (3, "3") and (MARKER_KEY in ds_config or MARKER_KEY in zero))


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
    odc_or_3 = is_odc_stage(stage) or stage in (3, "3")
    # "auto" is accelerate's placeholder, filled in later with the plugin's stage
    if isinstance(stage, str) and not is_odc_stage(stage) and stage != "auto" and not stage.strip().isdigit():
        raise ODCConfigError(f"zero_optimization.stage={stage!r}: allowed values are 0, 1, 2, 3 and \"odc\" (any "
                             "case); set one of them")
    if MARKER_KEY in zero and not odc_or_3:
        raise ODCConfigError(f"zero_optimization.odc is set but zero_optimization.stage={stage!r}: set "
                             '"stage": "odc" (or "stage": 3, the marker form) for the odc options, or remove them')
    if MARKER_KEY in ds_config and not odc_or_3:
        raise ODCConfigError(f"odc options (the top-level odc block) with zero_optimization.stage={stage!r}: set "
                             '"stage": "odc" for them, or remove the block')


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
    options = requested_options(ds_config)
    if options is None:
        switched = env_switch() if stage_three(ds_config) else None
        if switched is None:
            return None
        options = parse_options(switched, ENV_OPTIONS)
        asked_by = f"{ENV_SWITCH}=odc"
    check_compatibility(ds_config, options, asked_by)
    zero = ds_config["zero_optimization"]
    zero.pop(MARKER_KEY, None)
    if is_odc_stage(zero.get("stage")):
        zero["stage"] = 3
    # Defaults left out: accelerate treats every "auto" string in a ds_config as a placeholder it must
    # fill (and raises for keys it does not know), and "auto" is the default of two options.
    ds_config[MARKER_KEY] = options.model_dump(exclude_defaults=True)
    return options
