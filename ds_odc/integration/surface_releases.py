"""The release series: where the supported releases differ (:data:`CHANGES`, each a :class:`Change` whose constant
adapter code asks :func:`ds_odc.integration.surface.has` about), and the parts of ds_odc a job asks for whose
private names only they need (:data:`FEATURES`). The one place that knows which release changed what: the entries
of :data:`~ds_odc.integration.surface_table.SURFACE` name these constants (``since=`` / ``before=``,
``feature=``), never a version number."""
from __future__ import annotations

from ds_odc.integration.surface_types import Change, Feature

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
TRAINER_SEQUENCE_PARALLEL = Change("TRAINER_SEQUENCE_PARALLEL", "5.0.0", "Trainer.get_sp_size(): ALST's sequence "
                                   "parallelism through accelerate's ParallelismConfig", "no sequence parallelism in "
                                   "the Trainer: the balance block places each rank as a group of one",
                                   package="transformers")
#: accelerate, within its tested range
ACCELERATE_ULYSSES_LOADER = Change("ACCELERATE_ULYSSES_LOADER", "1.12.0", "Accelerator.deepspeed_ulysses_dl_adapter, "
                                   "which shards each batch over its sequence-parallel group (sp_backend "
                                   "'deepspeed')", "no sequence parallelism in accelerate: the balance block never "
                                   "binds the adapter", package="accelerate")
CHANGES = (ULYSSES_VARIABLE_LENGTH, TORCH_STYLE_BACKWARD, LOAD_DS_CONFIG, ULYSSES_CORE_ATTN, COALESCE_GRAD_REDUCTION,
           CHECKPOINT_STATE, IPG_BUCKET_GROUP, MANAGED_ACCUMULATION, NORM_DTYPE, ALL_TO_ALL_GROUPS,
           TRAINER_SEQUENCE_PARALLEL, TRAINER_RUN_EPOCH, ACCELERATE_ULYSSES_LOADER)


#: Long samples split over ranks (:mod:`ds_odc.integration.split_attention`).
SPLIT_POLICY = Feature("SPLIT_POLICY", "balance policy 'lb-mini-split'", since=ULYSSES_VARIABLE_LENGTH)
FEATURES = (SPLIT_POLICY,)
