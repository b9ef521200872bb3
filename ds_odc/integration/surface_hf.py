"""The private names of accelerate and transformers that ds_odc's Hugging Face glue relies on
(:data:`HF_SURFACE`): what the autoload and ``ds_odc.integration.hf`` patch in accelerate's DeepSpeed config, what
a Trainer that asks for ODC is bound through (``hf_trainer``, ``hf_balance``, the rebuilt training loader), and
the attention hooks only the split policy needs. Part of :data:`ds_odc.integration.surface_table.SURFACE`; data
only.

Both packages are optional (:data:`OPTIONAL_PACKAGES`): ``import ds_odc`` must not import transformers (seconds),
so these entries are checked only on request (``check_surface(include_hf=True)``), for the packages installed, by a
feature that needs them, and by the unit tests against the pinned and the declared releases."""
from __future__ import annotations

from ds_odc.integration.surface_releases import (
    ACCELERATE_ULYSSES_LOADER,
    SPLIT_POLICY,
    TRAINER_RUN_EPOCH,
    TRAINER_SEQUENCE_PARALLEL,
)
from ds_odc.integration.surface_types import (
    BALANCE,
    COST,
    HF,
    HF_METRICS,
    HF_SP,
    LOADER,
    PACKED,
    SPLIT,
    TRAINER,
    Kind,
    PrivateName,
)

_FLASH_KWARGS = ("transformers.modeling_flash_attention_utils", "FlashAttentionKwargs")

#: Packages ds_odc works without; their entries are checked only on request (see :mod:`ds_odc.integration.surface`).
OPTIONAL_PACKAGES = ("accelerate", "transformers")

HF_SURFACE: tuple[PrivateName, ...] = (
    # -- accelerate (optional) ---------------------------------------------------------------------------
    PrivateName("accelerate.utils.dataclasses", "DeepSpeedPlugin", "ACCELERATE_DEEPSPEED_ZERO_STAGE", Kind.FILE_NAME,
                "ds_odc_import_hooks.py",
                "the variable axolotl sets; ds_odc reads \"odc\" there as stage 3 plus its switch",
                found_in="__post_init__"),
    PrivateName("accelerate.utils.deepspeed", "HfDeepSpeedConfig", "set_stage_and_offload", Kind.METHOD,
                f"{HF}, ds_odc_autoload.py", "patched: canonicalises a config that mentions 'odc' first (any other "
                "goes straight to it)"),
    PrivateName("accelerate.utils.deepspeed", "HfDeepSpeedConfig", "config", Kind.INSTANCE_ATTRIBUTE,
                f"{HF}, {TRAINER}, {LOADER}", "the ds_config canonicalised in place; where a Trainer's odc options "
                "are read", found_in="__init__"),
    PrivateName("accelerate.utils.deepspeed", "DeepSpeedEngineWrapper", "engine", Kind.INSTANCE_ATTRIBUTE,
                f"{TRAINER}, {BALANCE}, {COST}", "the engine (released; stepped; timed)", found_in="__init__"),
    PrivateName("accelerate.accelerator", "Accelerator", "_models", Kind.INSTANCE_ATTRIBUTE, TRAINER,
                "forgets the released inference engine", found_in="__init__"),
    PrivateName("accelerate.accelerator", "Accelerator", "deepspeed_engine_wrapped", Kind.INSTANCE_ATTRIBUTE,
                f"{TRAINER}, {BALANCE}, {COST}", "the training engine (released; stepped; timed)",
                found_in="__init__"),
    PrivateName("accelerate.state", "GradientState", "_set_sync_gradients", Kind.METHOD, BALANCE,
                "the accumulation boundary on a slot's last micro-batch only"),
    PrivateName("accelerate.data_loader", None, "_PYTORCH_DATALOADER_KWARGS", Kind.MODULE_ATTRIBUTE, LOADER,
                "the DataLoader settings carried into the rebuilt training loader"),
    PrivateName("accelerate.data_loader", "DataLoaderShard", "rng_types", Kind.INSTANCE_ATTRIBUTE, LOADER,
                "carried into the rebuilt training loader", found_in="__init__"),
    PrivateName("accelerate.data_loader", "DataLoaderShard", "synchronized_generator", Kind.INSTANCE_ATTRIBUTE,
                LOADER, "carried into the rebuilt training loader", found_in="__init__"),
    PrivateName("accelerate.data_loader", "DataLoaderShard", "iteration", Kind.INSTANCE_ATTRIBUTE, LOADER,
                "carried into the rebuilt training loader", found_in="__init__"),
    PrivateName("accelerate.data_loader", "BatchSamplerShard", "split_batches", Kind.INSTANCE_ATTRIBUTE, LOADER,
                "replays the sharding for every rank", found_in="__init__"),
    PrivateName("accelerate.data_loader", "BatchSamplerShard", "even_batches", Kind.INSTANCE_ATTRIBUTE, LOADER,
                "replays the sharding for every rank", found_in="__init__"),
    PrivateName("accelerate.accelerator", "Accelerator", "deepspeed_ulysses_dl_adapter", Kind.METHOD, HF_SP,
                "bound on a balance Trainer's accelerator under SP: a planned loader, which already yields this "
                "rank's slices, is left as it is", since=ACCELERATE_ULYSSES_LOADER),
    # -- transformers (optional) -------------------------------------------------------------------------
    PrivateName("transformers.trainer", "Trainer", "__init__", Kind.METHOD, TRAINER,
                "the one class-level hook, once a config asks for odc: binds the Trainers that ask, per instance"),
    PrivateName("transformers.training_args", "TrainingArguments", "hf_deepspeed_config", Kind.INSTANCE_ATTRIBUTE,
                f"{TRAINER}, {LOADER}", "the ds_config whose odc options bind a Trainer", found_in="__post_init__"),
    PrivateName("transformers.trainer", "Trainer", "is_deepspeed_enabled", Kind.INSTANCE_ATTRIBUTE, TRAINER,
                "only a Trainer on DeepSpeed can ask for odc", found_in="create_accelerator_and_postprocess"),
    PrivateName("transformers.trainer", "Trainer", "deepspeed", Kind.INSTANCE_ATTRIBUTE, f"{TRAINER}, {BALANCE}",
                "forgets the released inference engine; its utilisation", found_in="__init__"),
    PrivateName("transformers.trainer", "Trainer", "accelerator", Kind.INSTANCE_ATTRIBUTE,
                f"{TRAINER}, {BALANCE}, {COST}", "where the engine is registered; a slot's local gathers",
                found_in="create_accelerator_and_postprocess"),
    PrivateName("transformers.trainer", "Trainer", "get_batch_samples", Kind.METHOD, BALANCE,
                "bound on balance Trainers: a step's slots and its global loss-token count"),
    PrivateName("transformers.trainer", "Trainer", "_get_num_items_in_batch", Kind.METHOD, BALANCE,
                "the Trainer's own loss-token count, over a slot's micro-batches"),
    PrivateName("transformers.trainer", "Trainer", "_track_num_input_tokens", Kind.METHOD, BALANCE,
                "bound on balance Trainers: counts over a slot's micro-batches", since=TRAINER_RUN_EPOCH),
    PrivateName("transformers.trainer", "Trainer", "current_gradient_accumulation_steps", Kind.INSTANCE_ATTRIBUTE,
                BALANCE, "the divisor of a mean loss: the global micro-batch count over the world",
                found_in="_run_epoch", since=TRAINER_RUN_EPOCH),
    PrivateName("transformers.trainer", "Trainer", "log", Kind.METHOD, f"{TRAINER}, {HF_METRICS}",
                "bound on every ODC Trainer: the ODC/... figures added to each training log (those with 'loss'), "
                "so report_to shows them"),
    PrivateName("transformers.trainer", "Trainer", "model_wrapped", Kind.INSTANCE_ATTRIBUTE, TRAINER,
                "set back to the bare model when the inference engine evaluate() left is released: train() then "
                "builds a training engine instead of reusing the wrapped one", found_in="__init__"),
    PrivateName("transformers.trainer", "Trainer", "get_sp_size", Kind.METHOD, HF_SP,
                "the SP group size the balance block places ranks by (read with getattr: renamed, every rank would "
                "be placed as a group of one, silently)", since=TRAINER_SEQUENCE_PARALLEL),
    PrivateName("transformers.configuration_utils", "PretrainedConfig", "_attn_implementation",
                Kind.CLASS_ATTRIBUTE, f"{SPLIT}, ds_odc/integration/sequence_parallel.py",
                "which attention implementation the model calls (the entry the split policy hooks; under fixed SP, "
                "whether it can keep samples and windows apart without the mask ALST drops)"),
    # -- split micro-batches (policy "lb-mini-split"): the attention hook ALST uses, in transformers -------------
    # Checked when a job asks for the policy (SPLIT_POLICY), not at import: another release lacking one of them
    # refuses this policy by name and runs everything else.
    PrivateName("transformers.modeling_utils", None, "ALL_ATTENTION_FUNCTIONS", Kind.MODULE_ATTRIBUTE, SPLIT,
                "the hook ALST uses: the model's attention implementation replaced by the split dispatcher",
                feature=SPLIT_POLICY),
    PrivateName("transformers.models.llama.modeling_llama", "LlamaAttention", "num_key_value_groups",
                Kind.INSTANCE_ATTRIBUTE, SPLIT, "set by Ulysses when it replicates key/value heads; put back for "
                "whole micro-batches", found_in="__init__", feature=SPLIT_POLICY),
    PrivateName("transformers.trainer", "Trainer", "model_accepts_loss_kwargs", Kind.INSTANCE_ATTRIBUTE, LOADER,
                "whether the model's loss takes num_items_in_batch: the split policy needs a loss normalised by the "
                "step's token count (refused without it, or a compute_loss_func)", found_in="__init__",
                feature=SPLIT_POLICY),
    PrivateName("transformers.trainer", "Trainer", "compute_loss_func", Kind.INSTANCE_ATTRIBUTE, LOADER,
                "the user's loss function, which is given num_items_in_batch", found_in="__init__",
                feature=SPLIT_POLICY),
    # packed samples attend each within itself, with each layer's own form (packed_attention's per-sample attention)
    PrivateName("transformers.integrations.sdpa_attention", None, "sdpa_attention_forward", Kind.MODULE_ATTRIBUTE,
                PACKED, "tells transformers' sdpa, which carries a sliding window only in the mask, from attentions "
                "that take the window keyword: sdpa gets a window mask per sample", feature=SPLIT_POLICY),
    PrivateName("transformers.models.mistral.modeling_mistral", "MistralAttention", "sliding_window=",
                Kind.SOURCE_TEXT, PACKED, "the window reaches the attention function as a keyword, which the "
                "per-sample attention applies to each sample (without it, every layer would attend over the whole "
                "sample, silently)", found_in="forward", feature=SPLIT_POLICY),
    PrivateName("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", "sliding_window",
                Kind.INSTANCE_ATTRIBUTE, PACKED, "each layer's window (None on full-attention layers), which its "
                "forward passes as the keyword the per-sample attention applies", found_in="__init__",
                feature=SPLIT_POLICY),
    PrivateName("transformers.models.qwen2.modeling_qwen2", "Qwen2Attention", "sliding_window=", Kind.SOURCE_TEXT,
                PACKED, "the layer's window reaches the attention function as a keyword (without it, sliding layers "
                "would attend over the whole sample, silently)", found_in="forward", feature=SPLIT_POLICY),
    *(PrivateName(*_FLASH_KWARGS, key, Kind.TYPED_DICT_KEY, PACKED, "a varlen keyword of a packed sequence "
                  "(DataCollatorWithFlattening(return_flash_attn_kwargs=True)), cut to each sample: a flash attention "
                  "would otherwise run every sample over the whole sequence's offsets", feature=SPLIT_POLICY)
      for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")),
)
