"""The table of every private name of DeepSpeed, torch, accelerate and transformers that ds_odc relies
on (:data:`SURFACE`; which releases have which form: :data:`CHANGES`; names only one feature needs: :data:`FEATURES`),
and of every process-wide effect ds_odc has (:data:`PROCESS_WIDE`). Data only:
:mod:`ds_odc.integration.surface` checks the names and explains what each check proves."""
from __future__ import annotations

import dataclasses
import enum


class Kind(enum.Enum):
    """How ds_odc depends on a name, which decides how it is checked (see :mod:`ds_odc.integration.surface`)."""
    MODULE_ATTRIBUTE = "module attribute"
    METHOD = "method"
    CLASS_ATTRIBUTE = "class attribute"
    DATACLASS_FIELD = "dataclass field"
    INSTANCE_ATTRIBUTE = "instance attribute"
    PARAMETER_ATTRIBUTE = "parameter attribute"
    CALL_TIME_LOOKUP = "looked up at call time"
    CHECKPOINT_KEY = "checkpoint key"
    FILE_NAME = "file name part"
    SOURCE_TEXT = "text in the source"
    SIGNATURE = "call signature"


@dataclasses.dataclass(frozen=True)
class Change:
    """A difference between two supported releases of ``package`` (DeepSpeed, or transformers / accelerate within
    their tested ranges). ``release`` is the first with the newer form.

    Entries of :data:`SURFACE` say which form they belong to (``since=`` the change, or ``before=`` it), so the
    import-time check holds each release to its own form. Adapter code that must act differently asks
    :func:`ds_odc.integration.surface.has` about the change by its constant here, never about a version number:
    this table is the one place that knows which release changed what."""
    key: str  # the constant's name here, which the adapter files that act on the change refer to
    release: str
    newer: str  # what the releases from ``release`` on have
    older: str  # what the earlier releases have, and what ds_odc does there
    package: str = "deepspeed"


#: The differences within the supported range (:data:`ds_odc.integration.versions.DEEPSPEED_RANGE`), oldest first.
TORCH_STYLE_BACKWARD = Change("TORCH_STYLE_BACKWARD", "0.18.3", "loss.backward() on an engine (DeepSpeedEngine."
                              "_backward_post_hook, _backward_prologue_per_tensor, _running_engine_backward)",
                              "engine.backward() only: ODCEngine's overrides of those hooks are never called")
ULYSSES_VARIABLE_LENGTH = Change("ULYSSES_VARIABLE_LENGTH", "0.18.2", "UlyssesSPAttentionHF(..., seq_length_is_"
                                 "variable=True) without local_seq_length / global_seq_length",
                                 "both are required: the split policy's groups cannot build their Ulysses attention "
                                 "as ds_odc calls it, and the policy is refused by name at initialize")
LOAD_DS_CONFIG = Change("LOAD_DS_CONFIG", "0.18.6", "deepspeed.runtime.tensor_parallel.init_utils.load_ds_config "
                        "reads a ds_config given as a path", "ds_odc reads the file as DeepSpeedConfig does (hjson, "
                        "duplicate keys refused with DeepSpeed's own hook)")
COALESCE_GRAD_REDUCTION = Change("COALESCE_GRAD_REDUCTION", "0.19.1", "engine.coalesce_grad_reduction() and the "
                                 "optimizer's _coalesce_grad_reduction flag", "no such block: every gradient goes "
                                 "through ZeRO-3's bucket, which ODC pushes")
CHECKPOINT_STATE = Change("CHECKPOINT_STATE", "0.19.3", "DeepSpeedEngine._common_checkpoint_state builds the "
                          "model-states dict", "_save_checkpoint builds it (the same keys)")
ULYSSES_CORE_ATTN = Change("ULYSSES_CORE_ATTN", "0.19.0", "UlyssesSPAttentionHF.core_attn_implementation "
                           "(its forward rebuilds flex_attention's block mask for the gathered sequence)",
                           "no such attribute, and a forward that never reads one: the split policy sets it all the "
                           "same, harmlessly (it refuses flex_attention, the one implementation it selects)")
IPG_BUCKET_GROUP = Change("IPG_BUCKET_GROUP", "0.19.3", "IPGBucketZ3.process_group, cleared with the bucket",
                          "buckets have no group: nothing to clear")
MANAGED_ACCUMULATION = Change("MANAGED_ACCUMULATION", "0.19.4", "\"managed_gradient_accumulation\": false "
                              "(DeepSpeedEngine.managed_gradient_accumulation(); every step() is the boundary)",
                              "DeepSpeed ignores the key and counts micro-steps; an ODC engine provides it (reads "
                              "the key, and every step() is its boundary); a ZeRO-3 engine stays managed, as "
                              "DeepSpeed has it")
ALL_TO_ALL_GROUPS = Change("ALL_TO_ALL_GROUPS", "0.19.7", "deepspeed.sequence.layer._all_to_all_groups: Ulysses "
                           "registers each group by name for its all-to-all operator, and never forgets it",
                           "no registry: the split policy's groups have nothing to forget when they are destroyed")
NORM_DTYPE = Change("NORM_DTYPE", "0.19.6", "deepspeed.runtime.zero.utils.get_norm_dtype(), the dtype ZeRO-3 sums "
                    "squared gradient norms in", "ZeRO-3 sums them in float64 (.double()): so does ODC")
#: transformers, within its tested range (:data:`ds_odc.integration.versions.TESTED_HF`)
TRAINER_RUN_EPOCH = Change("TRAINER_RUN_EPOCH", "5.3.0", "Trainer._run_epoch (where current_gradient_accumulation_"
                           "steps is set) and Trainer._track_num_input_tokens", "both inline in _inner_training_loop: "
                           "the balance block (which binds them per Trainer) is refused by name; the odc stage itself "
                           "works", package="transformers")
CHANGES = (ULYSSES_VARIABLE_LENGTH, TORCH_STYLE_BACKWARD, LOAD_DS_CONFIG, ULYSSES_CORE_ATTN, COALESCE_GRAD_REDUCTION,
           CHECKPOINT_STATE, IPG_BUCKET_GROUP, MANAGED_ACCUMULATION, NORM_DTYPE, ALL_TO_ALL_GROUPS,
           TRAINER_RUN_EPOCH)


@dataclasses.dataclass(frozen=True)
class Feature:
    """A part of ds_odc a job asks for, whose private names the rest of ds_odc does not need. Its entries
    (``feature=`` it) are not checked at ``import ds_odc``: the feature checks them when a job asks for it
    (:func:`ds_odc.integration.surface.require_feature`, at ``initialize``), and is refused there, by name, on a
    release that lacks one, while every other feature works. ``since``: the feature is refused on the releases
    before that change (its ``older`` says why); on those, its entries are not required of the release."""
    key: str  # the constant's name here
    name: str  # as a user asks for it, e.g. "balance policy 'lb-mini-split'"
    since: Change | None = None


#: Long samples split over ranks (:mod:`ds_odc.integration.split_attention`).
SPLIT_POLICY = Feature("SPLIT_POLICY", "balance policy 'lb-mini-split'", since=ULYSSES_VARIABLE_LENGTH)
FEATURES = (SPLIT_POLICY,)


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One name ds_odc relies on, where it lives, and which ds_odc file needs it for what."""
    module: str
    cls: str | None  # None: the name belongs to the module; "Outer.Inner" for a nested class
    name: str  # as ds_odc spells it: name-mangled names in their mangled form
    kind: Kind
    used_by: str  # the file(s) that use it, from the repository root
    why: str
    found_in: str | None = None  # source checks: a function of ``cls`` (else of the module), or a file
    since: Change | None = None  # the entry holds from this change's release on (None: every supported release)
    before: Change | None = None  # the entry holds only before this change's release
    feature: Feature | None = None  # checked for this feature only, when a job asks for it (None: at import)

    @property
    def owner(self) -> str:
        return f"{self.module}.{self.cls}" if self.cls else self.module

    @property
    def package(self) -> str:
        return self.module.split(".")[0]

    def describe(self) -> str:
        """Where the name was expected, e.g. ``self.lp_param_buffer assigned in deepspeed...Stage3._create_...``."""
        if self.found_in and "/" in self.found_in:
            where = f"{self.module.replace('.', '/')}/{self.found_in}"
        else:
            where = f"{self.owner}.{self.found_in}"
        return {
            Kind.INSTANCE_ATTRIBUTE: f"self.{self.name} assigned in {where}",
            Kind.PARAMETER_ATTRIBUTE: f"param.{self.name} assigned in {where}",
            Kind.CALL_TIME_LOOKUP: f"{self.name} looked up at call time by {where}",
            Kind.CHECKPOINT_KEY: f"checkpoint key {self.name!r} written by {where}",
            Kind.FILE_NAME: f"file name part {self.name!r} in {where}",
            Kind.SOURCE_TEXT: f"{self.name!r} in the source of {where}",
            Kind.SIGNATURE: f"{where} called with the keywords {self.name} alone",
        }.get(self.kind, f"{self.kind.value} {self.owner}.{self.name}")

    @property
    def releases(self) -> str:
        """The releases the entry holds for, as a specifier of the change's package ("" for every supported one)."""
        change = self.since or self.before
        if change is None:
            return ""
        return change.package + ",".join(([f">={self.since.release}"] if self.since else []) +
                                         ([f"<{self.before.release}"] if self.before else []))


#: Packages ds_odc works without; their entries are checked only on request (see :mod:`ds_odc.integration.surface`).
OPTIONAL_PACKAGES = ("accelerate", "transformers")

# The files that use the names.
_OPT, _PARAMS = "ds_odc/integration/zero3_optimizer.py", "ds_odc/integration/zero3_params.py"
_WINDOWS, _CKPT = "ds_odc/integration/zero3_windows.py", "ds_odc/integration/checkpoints.py"
_FROZEN, _ACTIVATIONS = "ds_odc/integration/zero3_frozen.py", "ds_odc/integration/activation_offload.py"
_INIT, _METRICS = "ds_odc/integration/initialize.py", "ds_odc/integration/metrics_hooks.py"
_TIMEOUTS, _SHM = "ds_odc/integration/timeouts.py", "ds_odc/integration/clean_exit.py"
_HF, _TRAINER, _ENGINE = "ds_odc/integration/hf.py", "ds_odc/integration/hf_trainer.py", "ds_odc/integration/engine.py"
_BALANCE, _LOADER, _COST = ("ds_odc/integration/hf_balance.py", "ds_odc/integration/hf_balance_loader.py",
                            "ds_odc/integration/hf_cost.py")
_SPLIT = "ds_odc/integration/split_attention.py"
_ULYSSES = "deepspeed.runtime.sequence_parallel.ulysses_sp"

_ENG, _Z3 = "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3"
_PP, _COORD = "deepspeed.runtime.zero.partition_parameters", "deepspeed.runtime.zero.partitioned_param_coordinator"
_ENGINE_CLS, _STAGE3 = "DeepSpeedEngine", "DeepSpeedZeroOptimizer_Stage3"


def _parameter_attribute(name: str, used_by: str, why: str) -> PrivateName:
    """An attribute ``Init._convert_to_deepspeed_param`` attaches to every parameter ZeRO-3 partitions."""
    return PrivateName(_PP, "Init", name, Kind.PARAMETER_ATTRIBUTE, used_by, why,
                       found_in="_convert_to_deepspeed_param")


SURFACE: tuple[PrivateName, ...] = (
    # -- deepspeed: initialize, config parsing, timeouts, shared memory -------------------------------
    PrivateName("deepspeed", None, "DeepSpeedEngine", Kind.MODULE_ATTRIBUTE, _INIT,
                "swapped for ODCEngine while deepspeed.initialize runs"),
    PrivateName("deepspeed", None, "DeepSpeedEngine", Kind.CALL_TIME_LOOKUP, _INIT, "so the swap reaches it",
                found_in="initialize"),
    PrivateName("deepspeed.runtime.config", None, "get_zero_config", Kind.MODULE_ATTRIBUTE, _INIT,
                "patched: a raw 'odc' dict parses as stage 3"),
    PrivateName("deepspeed.runtime.config", "DeepSpeedConfig", "get_zero_config", Kind.CALL_TIME_LOOKUP, _INIT,
                "so the patch reaches it", found_in="_initialize_params"),
    PrivateName("deepspeed.runtime.config", "DeepSpeedConfig", "_param_dict", Kind.INSTANCE_ATTRIBUTE, _ENGINE,
                "the raw ds_config, where the 'odc' options are read", found_in="__init__"),
    PrivateName("deepspeed.runtime.tensor_parallel.init_utils", None, "load_ds_config", Kind.MODULE_ATTRIBUTE, _INIT,
                "reads a ds_config given as a path, as deepspeed.initialize does", since=LOAD_DS_CONFIG),
    PrivateName("deepspeed.runtime.config_utils", None, "dict_raise_error_on_duplicate_keys", Kind.MODULE_ATTRIBUTE,
                _INIT, "reads a ds_config given as a path as DeepSpeedConfig does", before=LOAD_DS_CONFIG),
    PrivateName("deepspeed.constants", None, "default_pg_timeout", Kind.MODULE_ATTRIBUTE, _TIMEOUTS,
                "the silent-peer bound when the process group's cannot be read"),
    PrivateName("deepspeed", None, "deepspeed_allreduce_buffer", Kind.FILE_NAME, _SHM,
                "the /dev/shm buffer of DeepSpeed's CPU all-reduce, unlinked once mapped",
                found_in="ops/csrc/cpu/comm/shm.cpp"),
    # -- deepspeed.runtime.engine.DeepSpeedEngine: the base of ODCEngine ----------------------------------
    PrivateName(_ENG, _ENGINE_CLS, "_configure_zero_optimizer", Kind.METHOD, _ENGINE,
                "overridden: builds ODCStage3Optimizer"),
    PrivateName(_ENG, _ENGINE_CLS, _STAGE3, Kind.CALL_TIME_LOOKUP, _ENGINE,
                "imported at call time, so the module-attribute swap reaches it",
                found_in="_configure_zero_optimizer"),
    PrivateName(_ENG, _ENGINE_CLS, "_backward_prologue_per_tensor", Kind.METHOD, _ENGINE,
                "overridden: no 1/gradient_accumulation_steps for per-token micro-batches", since=TORCH_STYLE_BACKWARD),
    PrivateName(_ENG, _ENGINE_CLS, "_backward_post_hook", Kind.METHOD, _ENGINE,
                "overridden: a ledger entry per loss.backward()", since=TORCH_STYLE_BACKWARD),
    PrivateName(_ENG, _ENGINE_CLS, "_take_model_step", Kind.METHOD, _ENGINE,
                "overridden: global_samples counts the global micro-batches; its zero_grad stays local"),
    PrivateName(_ENG, _ENGINE_CLS, "_backward_epilogue", Kind.METHOD, _ENGINE,
                "overridden: marks DeepSpeed's own allreduce_gradients call inside backward"),
    PrivateName("deepspeed.comm", None, "barrier", Kind.MODULE_ATTRIBUTE, _CKPT,
                "swapped for an ODC barrier round while save_checkpoint runs (fails fast on a failed peer)"),
    PrivateName(_ENG, _ENGINE_CLS, "barrier", Kind.CALL_TIME_LOOKUP, _CKPT, "so the swap reaches its barriers",
                found_in="save_checkpoint"),
    PrivateName(_ENG, _ENGINE_CLS, "_get_ckpt_name", Kind.METHOD, _CKPT,
                "the model-states file fsynced before 'latest'"),
    PrivateName(_ENG, _ENGINE_CLS, "_get_zero_ckpt_name", Kind.METHOD, _CKPT,
                "the optimizer-states file fsynced before 'latest'"),
    PrivateName(_ENG, _ENGINE_CLS, "load_universal_checkpoint", Kind.METHOD, _CKPT,
                "whether a load is a universal one"),
    PrivateName(_ENG, _ENGINE_CLS, "managed_gradient_accumulation", Kind.METHOD, f"{_ENGINE}, {_METRICS}",
                "whether DeepSpeed decides the accumulation boundary", since=MANAGED_ACCUMULATION),
    PrivateName(_ENG, _ENGINE_CLS, "(self.micro_steps + 1) % self.gradient_accumulation_steps() == 0",
                Kind.SOURCE_TEXT, _ENGINE, "the micro-step boundary an unmanaged ODC engine replaces (every step())",
                found_in="is_gradient_accumulation_boundary", before=MANAGED_ACCUMULATION),
    PrivateName(_ENG, _ENGINE_CLS, "_is_gradient_accumulation_boundary", Kind.INSTANCE_ATTRIBUTE, _ENGINE,
                "a boundary the caller set wins over an unmanaged ODC engine's", found_in="__init__",
                before=MANAGED_ACCUMULATION),
    PrivateName(_ENG, _ENGINE_CLS, "_config", Kind.INSTANCE_ATTRIBUTE, _ENGINE, "holds the raw ds_config",
                found_in="__init__"),
    PrivateName(_ENG, _ENGINE_CLS, "_running_engine_backward", Kind.INSTANCE_ATTRIBUTE, _ENGINE,
                "tells loss.backward() from engine.backward()", found_in="__init__", since=TORCH_STYLE_BACKWARD),
    PrivateName(_ENG, _ENGINE_CLS, "global_samples", Kind.INSTANCE_ATTRIBUTE, _ENGINE,
                "re-set from the global micro-batch count", found_in="__init__"),
    PrivateName(_ENG, _ENGINE_CLS, "sequence_parallel_size", Kind.INSTANCE_ATTRIBUTE,
                "ds_odc/integration/sequence_parallel.py", "the SP group size an ALST mpu gave",
                found_in="_configure_distributed_model"),
    PrivateName(_ENG, _ENGINE_CLS, "seq_parallel_group", Kind.INSTANCE_ATTRIBUTE,
                "ds_odc/integration/sequence_parallel.py", "the ranks of this rank's SP group (the lockstep)",
                found_in="_configure_distributed_model"),
    PrivateName(_ENG, _ENGINE_CLS, "global_steps", Kind.INSTANCE_ATTRIBUTE, _CKPT, "the default checkpoint tag",
                found_in="__init__"),
    PrivateName(_ENG, _ENGINE_CLS, "global_rank", Kind.INSTANCE_ATTRIBUTE, f"{_CKPT}, {_METRICS}",
                "rank 0 writes 'latest'; metrics rank", found_in="_set_distributed_vars"),
    PrivateName(_ENG, _ENGINE_CLS, "checkpoint_engine", Kind.INSTANCE_ATTRIBUTE, _CKPT,
                "decoupled engines commit 'latest' themselves", found_in="_configure_checkpointing"),
    PrivateName(_ENG, _ENGINE_CLS, "module", Kind.CHECKPOINT_KEY, _CKPT, "buffers restored after a universal load",
                found_in="_common_checkpoint_state",
                since=CHECKPOINT_STATE),
    PrivateName(_ENG, _ENGINE_CLS, "module", Kind.CHECKPOINT_KEY, _CKPT, "buffers restored after a universal load",
                found_in="_save_checkpoint",
                before=CHECKPOINT_STATE),
    PrivateName(_ENG, _ENGINE_CLS, "frozen_param_shapes", Kind.CHECKPOINT_KEY, _CKPT,
                "frozen parameters restored after a universal load", found_in="_common_checkpoint_state",
                since=CHECKPOINT_STATE),
    PrivateName(_ENG, _ENGINE_CLS, "frozen_param_shapes", Kind.CHECKPOINT_KEY, _CKPT,
                "frozen parameters restored after a universal load", found_in="_save_checkpoint",
                before=CHECKPOINT_STATE),
    PrivateName(_ENG, _ENGINE_CLS, "frozen_param_fragments", Kind.CHECKPOINT_KEY, _CKPT,
                "frozen parameters restored after a universal load", found_in="_common_checkpoint_state",
                since=CHECKPOINT_STATE),
    PrivateName(_ENG, _ENGINE_CLS, "frozen_param_fragments", Kind.CHECKPOINT_KEY, _CKPT,
                "frozen parameters restored after a universal load", found_in="_save_checkpoint",
                before=CHECKPOINT_STATE),
    PrivateName(_ENG, _ENGINE_CLS, "zero_pp_rank_", Kind.FILE_NAME, _CKPT,
                "counts and orders the saving ranks' files", found_in="_get_ckpt_name"),
    PrivateName(_ENG, _ENGINE_CLS, "_model_states.pt", Kind.FILE_NAME, _CKPT,
                "counts and orders the saving ranks' files", found_in="_get_ckpt_name"),
    PrivateName("deepspeed.runtime.checkpoint_engine.checkpoint_engine", "CheckpointEngine", "is_decoupled",
                Kind.METHOD, _CKPT, "decoupled engines commit 'latest' themselves"),
    # -- deepspeed.runtime.zero.stage3: the base of ODCStage3Optimizer ------------------------------------
    PrivateName(_Z3, None, _STAGE3, Kind.MODULE_ATTRIBUTE, _ENGINE,
                "swapped for the ODC optimizer during _configure_zero_optimizer"),
    PrivateName("deepspeed.runtime.superoffload.superoffload_stage3", None, _STAGE3, Kind.MODULE_ATTRIBUTE, _ENGINE,
                "imported before any swap, so SuperOffload subclasses ZeRO-3's class"),
    PrivateName("deepspeed.runtime.zero.utils", None, "get_norm_dtype", Kind.MODULE_ATTRIBUTE, _OPT,
                "the dtype ZeRO-3 sums squared gradient norms in, for the same norm round arithmetic",
                since=NORM_DTYPE),
    PrivateName(_Z3, _STAGE3, ".double().norm(2)", Kind.SOURCE_TEXT, _OPT,
                "ZeRO-3 sums squared gradient norms in float64: the norm round does too",
                found_in="get_grad_norm_direct", before=NORM_DTYPE),
    PrivateName(_Z3, _STAGE3, "_create_fp16_partitions_with_defragmentation", Kind.METHOD, _OPT,
                "overridden: the flat shard buffer moves into the parameter window"),
    PrivateName(_Z3, _STAGE3, f"_{_STAGE3}__reduce_and_partition_ipg_grads", Kind.METHOD, f"{_OPT}, {_METRICS}",
                "overridden: pushes instead of the reduce-scatter"),
    PrivateName(_Z3, _STAGE3, "_get_norm_groups", Kind.METHOD, f"{_OPT}, {_METRICS}",
                "overridden: one norm exchange"),
    PrivateName(_Z3, _STAGE3, "has_overflow", Kind.METHOD, _OPT,
                "overridden: the norm round's verdict (fp16 skips the same steps everywhere)"),
    PrivateName(_Z3, _STAGE3, "_get_fp32_grad_state_partition", Kind.METHOD, _OPT,
                "overridden: a gradient fence before safe_get/set_*_grad reads a partition"),
    PrivateName(_Z3, _STAGE3, "_post_step", Kind.METHOD, f"{_OPT}, {_METRICS}",
                "overridden: no persistent-parameter all-gather"),
    PrivateName(_Z3, _STAGE3, "_partition_all_parameters", Kind.METHOD, _OPT, "drops stale full copies after a load"),
    PrivateName(_Z3, _STAGE3, "_set_fp16_partitioned_groups_flat", Kind.METHOD, _WINDOWS,
                "rebuilds the flat groups on the window"),
    PrivateName(_Z3, _STAGE3, "_unflatten_partitioned_parameters", Kind.METHOD, _WINDOWS,
                "points every shard into the window"),
    PrivateName(_Z3, _STAGE3, "_overflow_check_and_loss_scale_update", Kind.METHOD, _METRICS, "timed as step wait"),
    PrivateName(_Z3, _STAGE3, "reduce_independent_p_g_buckets_and_remove_grads", Kind.METHOD, _OPT,
                "called without ZeRO-3's coalescing check: ODC pushes every backward's gradients"),
    PrivateName(_Z3, _STAGE3, "_coalesce_grad_reduction", Kind.INSTANCE_ATTRIBUTE, _OPT,
                "inside engine.coalesce_grad_reduction(): each gradient pushed as it comes", found_in="__init__",
                since=COALESCE_GRAD_REDUCTION),
    PrivateName(_Z3, _STAGE3, "reduce_ready_partitions_and_remove_grads", Kind.METHOD, _OPT,
                "overridden: a heartbeat per gradient"),
    PrivateName(_Z3, _STAGE3, "destroy", Kind.METHOD, _OPT, "overridden: releases windows and hooks"),
    PrivateName(_Z3, _STAGE3, "module", Kind.INSTANCE_ATTRIBUTE, f"{_OPT}, {_WINDOWS}",
                "every module gets a heartbeat hook; the partitioned parameters",
                found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "parameter_offload", Kind.INSTANCE_ATTRIBUTE, f"{_OPT}, {_METRICS}",
                "reaches the parameter coordinator", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "persistent_parameters", Kind.INSTANCE_ATTRIBUTE, _OPT,
                "pulled after the step instead of all-gathered", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "offload_param", Kind.INSTANCE_ATTRIBUTE, _WINDOWS,
                "where the shards live: with parameter offload, one host buffer per parameter group",
                found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "param_groups_fp16_flat_cpu_memory", Kind.INSTANCE_ATTRIBUTE, _WINDOWS,
                "the host buffers of parameter offload, rebound to slices of the window", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "_move_to_flat_buffer", Kind.METHOD, _WINDOWS,
                "moves each sub-group's offloaded shards into the window"),
    PrivateName(_Z3, _STAGE3, "offload_optimizer", Kind.INSTANCE_ATTRIBUTE, _OPT,
                "optimizer offload: the accumulator is copied into the host gradient buffers", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "swap_optimizer", Kind.INSTANCE_ATTRIBUTE, _OPT, "NVMe optimizer offload is refused",
                found_in="_configure_offloading"),
    PrivateName(_Z3, _STAGE3, "grad_position", Kind.INSTANCE_ATTRIBUTE, _OPT,
                "where each parameter's gradient sits in its sub-group's host buffer", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "fp32_partitioned_groups_flat", Kind.INSTANCE_ATTRIBUTE, _OPT,
                "the host gradient buffers (.grad) under optimizer offload", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "dp_process_group", Kind.INSTANCE_ATTRIBUTE, f"{_OPT}, {_CKPT}",
                "rank and world of the windows", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "reduce_and_partition_stream", Kind.INSTANCE_ATTRIBUTE, _OPT,
                "pushes run on ZeRO-3's reduce stream", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "gradient_accumulation_steps", Kind.INSTANCE_ATTRIBUTE, _OPT, "the mean rule's divisor",
                found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "fp16_groups", Kind.INSTANCE_ATTRIBUTE, f"{_OPT}, {_WINDOWS}",
                "the trainable parameters, by sub-group",
                found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "fp16_partitioned_groups_flat", Kind.INSTANCE_ATTRIBUTE, _WINDOWS,
                "rebuilt on the window",
                found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "averaged_gradients", Kind.INSTANCE_ATTRIBUTE, f"{_OPT}, {_WINDOWS}",
                "set to the accumulator views before the step", found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "ipg_buckets", Kind.INSTANCE_ATTRIBUTE, _OPT, "the bucket whose gradients are pushed",
                found_in="__init__"),
    PrivateName(_Z3, _STAGE3, "lp_param_buffer", Kind.INSTANCE_ATTRIBUTE, _WINDOWS, "replaced by the parameter window",
                found_in="_create_fp16_partitions_with_defragmentation"),
    PrivateName(_Z3, _STAGE3, "grad_partitions_flat_buffer", Kind.INSTANCE_ATTRIBUTE, _WINDOWS,
                "replaced by the gradient accumulator window", found_in="_setup_for_real_optimizer"),
    PrivateName(_Z3, _STAGE3, f"_{_STAGE3}__param_id_to_grad_partition", Kind.INSTANCE_ATTRIBUTE, _WINDOWS,
                "re-pointed at the accumulator window", found_in="_setup_for_real_optimizer"),
    PrivateName(_Z3, "IPGBucketZ3", "params", Kind.DATACLASS_FIELD, _OPT,
                "cleared after the pushes, as clear_params does"),
    PrivateName(_Z3, "IPGBucketZ3", "elements", Kind.DATACLASS_FIELD, _OPT, "cleared after the pushes"),
    PrivateName(_Z3, "IPGBucketZ3", "process_group", Kind.DATACLASS_FIELD, _OPT, "cleared after the pushes",
                since=IPG_BUCKET_GROUP),
    # -- deepspeed.runtime.zero: parameter offload, coordinator, parameter status ------------------------
    PrivateName("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "get_param_coordinator",
                Kind.METHOD, f"{_OPT}, {_METRICS}, {_FROZEN}",
                "the coordinator whose trace check is skipped and whose fetches are timed"),
    PrivateName("deepspeed.runtime.zero.parameter_offload", "DeepSpeedZeRoOffload", "module", Kind.INSTANCE_ATTRIBUTE,
                _FROZEN, "a frozen engine's partitioned parameters", found_in="__init__"),
    PrivateName(_COORD, None, "assert_ints_same_as_other_ranks", Kind.MODULE_ATTRIBUTE, _PARAMS,
                "swapped for a gate that skips the trace check on ODC coordinators"),
    PrivateName(_COORD, "PartitionedParameterCoordinator", "assert_ints_same_as_other_ranks", Kind.CALL_TIME_LOOKUP,
                _PARAMS, "so the gate reaches it", found_in="reset_step"),
    PrivateName(_COORD, "PartitionedParameterCoordinator", "reset_step", Kind.METHOD, _PARAMS,
                "wrapped to skip the trace check"),
    PrivateName(_COORD, "PartitionedParameterCoordinator", "fetch_sub_module", Kind.METHOD, _METRICS,
                "timed as a gather"),
    PrivateName(_PP, None, "ZeroParamStatus", Kind.MODULE_ATTRIBUTE, f"{_OPT}, {_PARAMS}",
                "the status a pull sets and reads"),
    PrivateName(_PP, "ZeroParamStatus", "AVAILABLE", Kind.CLASS_ATTRIBUTE, _PARAMS, "set when a pull completes"),
    PrivateName(_PP, "ZeroParamStatus", "INFLIGHT", Kind.CLASS_ATTRIBUTE, _PARAMS, "set while a pull is pending"),
    PrivateName(_PP, "ZeroParamStatus", "NOT_AVAILABLE", Kind.CLASS_ATTRIBUTE, f"{_OPT}, {_PARAMS}",
                "only released parameters are pulled"),
    # -- attributes Init attaches to every partitioned parameter -----------------------------------------
    _parameter_attribute("ds_id", f"{_OPT}, {_PARAMS}, {_FROZEN}", "the window slot of the parameter"),
    _parameter_attribute("ds_numel", f"{_WINDOWS}, {_PARAMS}, {_FROZEN}", "full size of a pull"),
    _parameter_attribute("ds_shape", _PARAMS, "shape of a pulled parameter"),
    _parameter_attribute("ds_tensor", f"{_WINDOWS}, {_PARAMS}, {_CKPT}, {_FROZEN}, {_ACTIVATIONS}",
                         "this rank's shard, moved into the window"),
    _parameter_attribute("ds_status", f"{_OPT}, {_PARAMS}", "pull state"),
    _parameter_attribute("partition_numel", _WINDOWS, "shard size in the window layout"),
    _parameter_attribute("ds_summary", _PARAMS, "names the parameter in an error"),
    _parameter_attribute("all_gather", _PARAMS, "replaced by a pull"),
    _parameter_attribute("all_gather_coalesced", _PARAMS, "replaced by a pull"),
    _parameter_attribute("partition", _PARAMS, "wrapped: waits for every owner after a modification"),
    # -- torch.distributed: the process group's timeout --------------------------------------------------
    # -- torch.utils.checkpoint: what "checkpoint_inputs" recognises ---------------------------------------
    PrivateName("torch.utils.checkpoint", None, "CheckpointFunction", Kind.MODULE_ATTRIBUTE, _ACTIVATIONS,
                "the reentrant checkpoint's autograd Function, whose apply saves the checkpoint inputs"),
    PrivateName("torch", "Tensor", "_base", Kind.CLASS_ATTRIBUTE, _ACTIVATIONS,
                "a view's root: a view of a parameter is never offloaded, an operation's own output needs no scan"),
    PrivateName("torch.multiprocessing.reductions", None, "StorageWeakRef", Kind.MODULE_ATTRIBUTE,
                "ds_odc/activations/hooks.py", "tells a storage still alive from a new one at a reused address"),
    PrivateName("torch.distributed.distributed_c10d", None, "_get_default_group", Kind.MODULE_ATTRIBUTE, _TIMEOUTS,
                "the world process group"),
    PrivateName("torch.distributed.distributed_c10d", None, "_get_default_store", Kind.MODULE_ATTRIBUTE, _INIT,
                "the job's store, where ranks agree on the odc stage before DeepSpeed's first collective"),
    PrivateName("torch.distributed", "ProcessGroup", "_get_backend", Kind.METHOD, _TIMEOUTS,
                "the group's CPU backend"),
    PrivateName("torch._C._distributed_c10d", "ProcessGroupGloo", "options", Kind.CLASS_ATTRIBUTE, _TIMEOUTS,
                "the backend's options"),
    PrivateName("torch._C._distributed_c10d", "Backend.Options", "_timeout", Kind.CLASS_ATTRIBUTE, _TIMEOUTS,
                "the bound for a silent peer; DeepSpeed's default without it"),
    PrivateName("deepspeed.launcher.runner", None, "EXPORT_ENVS", Kind.MODULE_ATTRIBUTE,
                "ds_odc/integration/__init__.py", "the prefixes the launcher exports to other nodes; DS_ODC_ added"),
    PrivateName("deepspeed.launcher.runner", None, "EXPORT_ENVS", Kind.CALL_TIME_LOOKUP,
                "ds_odc/integration/__init__.py", "read when the launcher starts the nodes", found_in="main"),
    # -- accelerate (optional) ---------------------------------------------------------------------------
    PrivateName("accelerate.utils.dataclasses", "DeepSpeedPlugin", "ACCELERATE_DEEPSPEED_ZERO_STAGE", Kind.FILE_NAME,
                "ds_odc_import_hooks.py",
                "the variable axolotl sets; ds_odc reads \"odc\" there as stage 3 plus its switch",
                found_in="__post_init__"),
    PrivateName("accelerate.utils.deepspeed", "HfDeepSpeedConfig", "set_stage_and_offload", Kind.METHOD,
                f"{_HF}, ds_odc_autoload.py", "patched: canonicalises a config that mentions 'odc' first (any other "
                "goes straight to it)"),
    PrivateName("accelerate.utils.deepspeed", "HfDeepSpeedConfig", "config", Kind.INSTANCE_ATTRIBUTE,
                f"{_HF}, {_TRAINER}, {_LOADER}", "the ds_config canonicalised in place; where a Trainer's odc options "
                "are read", found_in="__init__"),
    PrivateName("accelerate.utils.deepspeed", "DeepSpeedEngineWrapper", "engine", Kind.INSTANCE_ATTRIBUTE,
                f"{_TRAINER}, {_BALANCE}, {_COST}", "the engine (released; stepped; timed)", found_in="__init__"),
    PrivateName("accelerate.accelerator", "Accelerator", "_models", Kind.INSTANCE_ATTRIBUTE, _TRAINER,
                "forgets the released inference engine", found_in="__init__"),
    PrivateName("accelerate.accelerator", "Accelerator", "deepspeed_engine_wrapped", Kind.INSTANCE_ATTRIBUTE,
                f"{_TRAINER}, {_BALANCE}, {_COST}", "the training engine (released; stepped; timed)",
                found_in="__init__"),
    PrivateName("accelerate.state", "GradientState", "_set_sync_gradients", Kind.METHOD, _BALANCE,
                "the accumulation boundary on a slot's last micro-batch only"),
    PrivateName("accelerate.data_loader", None, "_PYTORCH_DATALOADER_KWARGS", Kind.MODULE_ATTRIBUTE, _LOADER,
                "the DataLoader settings carried into the rebuilt training loader"),
    PrivateName("accelerate.data_loader", "DataLoaderShard", "rng_types", Kind.INSTANCE_ATTRIBUTE, _LOADER,
                "carried into the rebuilt training loader", found_in="__init__"),
    PrivateName("accelerate.data_loader", "DataLoaderShard", "synchronized_generator", Kind.INSTANCE_ATTRIBUTE,
                _LOADER, "carried into the rebuilt training loader", found_in="__init__"),
    PrivateName("accelerate.data_loader", "DataLoaderShard", "iteration", Kind.INSTANCE_ATTRIBUTE, _LOADER,
                "carried into the rebuilt training loader", found_in="__init__"),
    PrivateName("accelerate.data_loader", "BatchSamplerShard", "split_batches", Kind.INSTANCE_ATTRIBUTE, _LOADER,
                "replays the sharding for every rank", found_in="__init__"),
    PrivateName("accelerate.data_loader", "BatchSamplerShard", "even_batches", Kind.INSTANCE_ATTRIBUTE, _LOADER,
                "replays the sharding for every rank", found_in="__init__"),
    # -- transformers (optional) -------------------------------------------------------------------------
    PrivateName("transformers.trainer", "Trainer", "__init__", Kind.METHOD, _TRAINER,
                "the one class-level hook, once a config asks for odc: binds the Trainers that ask, per instance"),
    PrivateName("transformers.training_args", "TrainingArguments", "hf_deepspeed_config", Kind.INSTANCE_ATTRIBUTE,
                f"{_TRAINER}, {_LOADER}", "the ds_config whose odc options bind a Trainer", found_in="__post_init__"),
    PrivateName("transformers.trainer", "Trainer", "is_deepspeed_enabled", Kind.INSTANCE_ATTRIBUTE, _TRAINER,
                "only a Trainer on DeepSpeed can ask for odc", found_in="create_accelerator_and_postprocess"),
    PrivateName("transformers.trainer", "Trainer", "deepspeed", Kind.INSTANCE_ATTRIBUTE, f"{_TRAINER}, {_BALANCE}",
                "forgets the released inference engine; its utilisation", found_in="__init__"),
    PrivateName("transformers.trainer", "Trainer", "accelerator", Kind.INSTANCE_ATTRIBUTE,
                f"{_TRAINER}, {_BALANCE}, {_COST}", "where the engine is registered; a slot's local gathers",
                found_in="create_accelerator_and_postprocess"),
    PrivateName("transformers.trainer", "Trainer", "get_batch_samples", Kind.METHOD, _BALANCE,
                "bound on balance Trainers: a step's slots and its global loss-token count"),
    PrivateName("transformers.trainer", "Trainer", "_get_num_items_in_batch", Kind.METHOD, _BALANCE,
                "the Trainer's own loss-token count, over a slot's micro-batches"),
    PrivateName("transformers.trainer", "Trainer", "_track_num_input_tokens", Kind.METHOD, _BALANCE,
                "bound on balance Trainers: counts over a slot's micro-batches", since=TRAINER_RUN_EPOCH),
    PrivateName("transformers.trainer", "Trainer", "current_gradient_accumulation_steps", Kind.INSTANCE_ATTRIBUTE,
                _BALANCE, "the divisor of a mean loss: the global micro-batch count over the world",
                found_in="_run_epoch", since=TRAINER_RUN_EPOCH),
    # -- split micro-batches (policy "lb-mini-split"): ALST's attention over groups chosen per micro-batch ------
    # Checked when a job asks for the policy (SPLIT_POLICY), not at import: another release lacking one of them
    # refuses this policy by name and runs everything else.
    PrivateName("transformers.modeling_utils", None, "ALL_ATTENTION_FUNCTIONS", Kind.MODULE_ATTRIBUTE, _SPLIT,
                "the hook ALST uses: the model's attention implementation replaced by the split dispatcher",
                feature=SPLIT_POLICY),
    PrivateName("transformers.configuration_utils", "PretrainedConfig", "_attn_implementation",
                Kind.CLASS_ATTRIBUTE, _SPLIT, "which attention implementation the model calls (the entry hooked)",
                feature=SPLIT_POLICY),
    PrivateName("transformers.models.llama.modeling_llama", "LlamaAttention", "num_key_value_groups",
                Kind.INSTANCE_ATTRIBUTE, _SPLIT, "set by Ulysses when it replicates key/value heads; put back for "
                "whole micro-batches", found_in="__init__", feature=SPLIT_POLICY),
    PrivateName(_ULYSSES, None, "UlyssesSPAttentionHF", Kind.MODULE_ATTRIBUTE, _SPLIT,
                "each group's attention over its members", feature=SPLIT_POLICY),
    PrivateName(_ULYSSES, "UlyssesSPAttentionHF", "attn, batch_size, attn_head_count, attn_head_size, kv_head_count, "
                "num_hidden_layers, process_group, seq_length_is_variable", Kind.SIGNATURE, _SPLIT,
                "how each group's Ulysses attention is built (a variable sequence length, none given)",
                found_in="__init__", feature=SPLIT_POLICY),
    PrivateName(_ULYSSES, "UlyssesSPAttentionHF", "core_attn_implementation", Kind.INSTANCE_ATTRIBUTE, _SPLIT,
                "set on each group's Ulysses attention, as register_with_transformers sets it", found_in="__init__",
                since=ULYSSES_CORE_ATTN, feature=SPLIT_POLICY),
    PrivateName("deepspeed.sequence.layer", None, "_all_to_all_groups", Kind.MODULE_ATTRIBUTE, _SPLIT,
                "a destroyed group is forgotten there too (else the registry keeps its threads and sockets)",
                since=ALL_TO_ALL_GROUPS, feature=SPLIT_POLICY),
)




@dataclasses.dataclass(frozen=True)
class ProcessWide:
    """Something ds_odc changes beyond its own objects, for how long, and why it cannot be narrower."""
    what: str
    lifetime: str
    why: str
    where: str


#: Every process-wide effect of ds_odc, and every replacement it makes on objects it does not own (parameters,
#: DeepSpeed's coordinators and optimizers, an engine ``ds_odc.metrics.attach`` is given). Each replacement
#: delegates unchanged to the original for anything that is not an ODC job; the scoped swaps last one call and
#: are restored on every exit path; the others are undone by ``destroy()`` or when the process ends, as stated.
#: Each is made through ``patching.py`` (``tests/unit/test_patching.py`` holds every file that patches to a line).
PROCESS_WIDE: tuple[ProcessWide, ...] = (
    ProcessWide("deepspeed.initialize replaced", "while ds_odc is registered (import ds_odc, or autoload)",
                "the one entry every launcher, accelerate and the HF Trainer go through; configs without the odc "
                "stage run the original unchanged", _INIT),
    ProcessWide("deepspeed.runtime.config.get_zero_config replaced", "while ds_odc is registered",
                "zero.Init(config_dict_or_path=<odc dict>) and other raw readers parse the dict; it works on a copy "
                "and leaves every other dict to the original", _INIT),
    ProcessWide("deepspeed.DeepSpeedEngine swapped for ODCEngine", "one deepspeed.initialize call of an odc config",
                "initialize looks the engine class up at call time", _INIT),
    ProcessWide("deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3 swapped", "one _configure_zero_optimizer "
                "call of an ODC engine", "DeepSpeed imports the class at call time and passes ~45 arguments", _ENGINE),
    ProcessWide("deepspeed.comm.barrier swapped for an ODC round", "one save_checkpoint call of an ODC engine",
                "DeepSpeed's save barriers must fail fast when a peer died", _CKPT),
    ProcessWide("partitioned_param_coordinator.assert_ints_same_as_other_ranks gated",
                "while ODC engines' parameter coordinators exist", "only ODC coordinators skip the trace check; "
                "every other coordinator's call goes to the original", _PARAMS),
    ProcessWide("an ODC engine's parameter coordinator: reset_step replaced by one that skips the trace check",
                "from the engine's build to its destroy()", "ranks of an ODC job keep their own trace; the "
                "instance attribute reaches this coordinator only", _PARAMS),
    ProcessWide("each partitioned parameter's all_gather, all_gather_coalesced and partition closures replaced "
                "by pulls", "from an ODC engine's build to its destroy() (ZeRO-3's closures put back)",
                "zero.Init attaches these closures to every parameter, and they are the only way the coordinator, "
                "GatheredParameters and the persistent-parameter refresh gather", _PARAMS),
    ProcessWide("the step recorder's hooks on one engine: its forward, backward, step and destroy, its optimizer's "
                "reduce, norm, overflow and post-step methods, its coordinator's fetch_sub_module, its protocol's "
                "round", "from the recorder's attach (an ODC engine's build, or ds_odc.metrics.attach) to the "
                "engine's destroy()", "the recorder listens where ZeRO-3 works, on that engine's objects only "
                "(no class is patched)", _METRICS),
    ProcessWide("torch.distributed.destroy_process_group replaced", "from the first ODC engine's build to the end of "
                "the process (a pass-through while no ODC engine is alive)", "a rank that tears its process group "
                "down with an ODC engine open has left training: its peers, waiting at a round, learn of it at once "
                "instead of at their no-progress bound", "ds_odc/integration/clean_exit.py"),
    ProcessWide("an ODC engine's model: its generate bound on the instance (synced_gpus False unless the caller "
                "says)", "from the engine's build to its destroy()", "transformers syncs every model's generation "
                "while a ZeRO-3 config is active; an ODC model's forwards are one-sided, so only that instance "
                "stops syncing (the class and every other model are left alone)",
                "ds_odc/integration/hf_generation.py"),
    ProcessWide("SIGTERM, SIGINT and SIGHUP handlers: first unlink the files this rank created, then the previous "
                "handler (or the default action)", "while a node's windows are allocated, main thread only; the "
                "previous handlers are put back on every exit, and a signal the process ignores stays ignored",
                "a rank stopped while allocating must leave nothing in /dev/shm (after allocation the files are "
                "already unlinked)", "ds_odc/comm/segments.py"),
    ProcessWide("accelerate's HfDeepSpeedConfig.set_stage_and_offload replaced", "once accelerate.utils.deepspeed is "
                "imported (by the autoload's guard before ds_odc is imported)", "the one reader from which "
                "transformers and accelerate learn the stage: a config mentioning odc is canonicalised in place (stage "
                "3 plus the marker); every other config goes straight to accelerate's method", _HF),
    ProcessWide("transformers' Trainer.__init__ replaced by a pass-through", "once a config asked for odc and "
                "transformers.trainer is imported (never in a job that does not use ODC)", "the only place every "
                "Trainer passes through; it binds ODC behaviour on the instances whose config asks for it, and leaves "
                "the class and every other Trainer exactly as transformers has them", _TRAINER),
    ProcessWide("methods bound on one Trainer instance whose config asks for odc: train (the inference engine "
                "released first), and with the balance block the slot behaviours (get_train_dataloader, "
                "get_batch_samples, training_step, ...); under SP its accelerator's deepspeed_ulysses_dl_adapter",
                "that Trainer's life", "the class and every other Trainer stay as transformers and accelerate have "
                "them; each bound method delegates to the class's own", f"{_TRAINER}, {_BALANCE}, "
                "ds_odc/integration/hf_sequence_parallel.py"),
    ProcessWide("a balanced Trainer's args.average_tokens_across_devices, and its accelerator's gather and "
                "gather_for_metrics, swapped", "one call (the loss-token count; one balanced micro-batch)",
                "the Trainer's own count without its per-rank gather; a gather per micro-batch cannot be "
                "collective when ranks run different counts", _BALANCE),
    ProcessWide("ACCELERATE_DEEPSPEED_ZERO_STAGE=odc rewritten to 3, with DS_ODC_STAGE3=odc set",
                "the process and its children (only when the variable says odc)", "accelerate calls int() on it; "
                "axolotl exports there the stage it is given", "ds_odc_import_hooks.py (at interpreter start by "
                "ds_odc_autoload.py, and when ds_odc registers)"),
    ProcessWide("deepspeed.launcher.runner.EXPORT_ENVS gains DS_ODC_", "the launcher process",
                "the environment switch must reach the ranks of every node the launcher starts",
                "ds_odc/integration/__init__.py"),
    ProcessWide("the sequence-parallel lockstep of the newest training ODC engine under an SP mpu",
                "from that engine's build to its destroy()", "ALST replaces the attention function process-wide, so "
                "a frozen model's forward (a DPO reference) meets the SP peers in all-to-alls too: it takes the same "
                "lockstep as the training engine's forwards", "ds_odc/integration/sequence_parallel.py"),
    ProcessWide("sys.excepthook chained", "while ODC engines live (restored when the last one closes)",
                "an uncaught exception reaches the peers as that exception, not as a bare exit",
                "ds_odc/runtime/crash.py"),
    ProcessWide("an atexit hook", "the process (DS_ODC_CLEAN_EXIT=0: none)", "gloo workers finish their last "
                "decref before finalisation; no collective, bounded wait", "ds_odc/integration/clean_exit.py"),
    ProcessWide("a post-import finder on sys.meta_path", "until the modules it waits for are imported",
                "ds_odc patches accelerate and transformers only once a program imports them",
                "ds_odc_import_hooks.py"),
    ProcessWide("transformers' ALL_ATTENTION_FUNCTIONS entry of the model's attention implementation (e.g. 'sdpa') "
                "replaced by the split dispatcher (the original for a whole micro-batch, Ulysses over the group inside "
                "a split one)", "from the build of an ODC engine with balance policy 'lb-mini-split' to its "
                "destroy()", "transformers looks the attention function up there at every call, and ALST hooks the "
                "same entry; a frozen model's forward inside a split micro-batch (a reference model) must meet the "
                "members too", _SPLIT),
)
