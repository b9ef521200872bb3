"""The option blocks nested inside the odc stage's options: ``balance`` (with its formula cost model),
``activation_offload`` and ``timeline``.

They live apart from :mod:`ds_odc.config` so that module keeps to the stage's own options
(:class:`~ds_odc.config.ODCConfig`, whose fields hold these blocks) and the routing of a ds_config to its
canonical form. Each block is a frozen, strict pydantic model; the string under each field is its documentation
(``make schema`` turns it into config_schemas/odc.schema.json and docs/options.md). Import them from either
module: :mod:`ds_odc.config` re-exports every one.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ActivationOffloadConfig", "BalanceConfig", "QuadraticCost", "TimelineConfig"]


class QuadraticCost(BaseModel):
    """``a·x² + b·x`` per sample with ``x = length / length_unit`` (plus a fixed cost per micro-batch)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    a: Annotated[float, Field(ge=0)]
    """Coefficient of the squared length (attention). At least 0."""

    b: Annotated[float, Field(ge=0)]
    """Coefficient of the length (everything linear in tokens). At least 0; a and b not both 0."""

    length_unit: Annotated[float, Field(gt=0)] = 1.0
    """Lengths are divided by this before the formula (a published fit is often per 32K tokens).
    Default 1."""

    per_micro_batch: Annotated[float, Field(ge=0)] = 0.0
    """Fixed cost of one micro-batch, in the unit of the formula (launches, pulls). Default 0."""

    @field_validator("b")
    @classmethod
    def _not_both_zero(cls, value: float, info) -> float:
        if value == 0 and info.data.get("a") == 0:
            raise ValueError("a and b are both 0: every sample would cost nothing; set a or b above 0")
        return value


class BalanceConfig(BaseModel):
    """The Hugging Face Trainer's micro-batches planned by ``ds_odc.balance`` (docs/balancing.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    policy: Literal["lb-mini", "lb-micro", "lb-mini-split"] = "lb-mini"
    """"lb-mini": each rank gets an equal share of the step's compute and runs it as its own number of
    micro-batches (zero allowed). "lb-micro": every rank runs the same number of micro-batches, balanced
    index by index (the equal-count baseline). "lb-mini-split": as "lb-mini", but a long sample may run
    split over an aligned group of ranks with Ulysses attention (groups chosen per step, up to max_group;
    packed micro-batches, per-token loss; docs/balancing.md). Default "lb-mini"."""

    token_cap: Annotated[int, Field(ge=1)]
    """Most tokens in one micro-batch, as the data collator produces it (a padded micro-batch counts its
    padded size). Required. A sample longer than the cap is an error naming it, but for "lb-mini-split", where it
    runs split over the smallest group that brings each member under the cap (up to max_group × token_cap)."""

    cost_model: Union[Literal["tokens", "measure"], QuadraticCost] = "tokens"
    """What a sample costs: "tokens" (its token count), {"a": ..., "b": ...} (``a·s² + b·s``), or
    "measure" (fitted once at the start of training from timed forward+backward passes of this model on
    this machine at several lengths up to token_cap, the same fit on every rank, logged). Default "tokens"."""

    padding: Literal["auto", "padded", "packed"] = "auto"
    """How the data collator lays out a micro-batch: "padded" (every sample padded to the longest: n·L
    tokens), "packed" (samples concatenated, as padding-free collators do: Σ lengths), or "auto" (decided
    by collating two samples of different lengths once). Default "auto"."""

    pad_to_multiple_of: Annotated[int, Field(ge=1)] = 1
    """With "padded": the collator's pad_to_multiple_of, so the plan prices the padded length. Default 1."""

    length_key: str = "input_ids"
    """The field of a dataset item whose length is the sample's token count. Default "input_ids"."""

    max_group: Optional[Literal[2, 4, 8]] = None
    """With "lb-mini-split": the most ranks one sample is split over (2, 4 or 8; groups are aligned blocks inside
    a node). The model's heads must allow it (query heads divisible by it, key/value heads dividing it or
    divisible by it): initialize refuses a group they do not allow, naming the heads. Default null: the largest
    the heads allow, at most 8. Only with "lb-mini-split"."""

    min_chunk_tokens: Annotated[int, Field(ge=1)] = 2048
    """With "lb-mini-split": the fewest tokens each member of a split micro-batch holds, so no sample shorter than
    twice this is split on its own (a sample longer than token_cap is split regardless). Default 2048; at least 1.
    Only with "lb-mini-split"."""

    @field_validator("max_group", "min_chunk_tokens")
    @classmethod
    def _split_only(cls, value, info):
        policy = info.data.get("policy")
        default = cls.model_fields[info.field_name].default
        if value != default and policy != "lb-mini-split":
            raise ValueError(f"only with policy 'lb-mini-split' (policy is {policy!r}); set that policy, or leave "
                             f"{info.field_name} out")
        return value


class ActivationOffloadConfig(BaseModel):
    """Saved activations copied to one host pool per micro-batch, as much as keeps the rest under a budget
    (docs/activation_offload.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    budget_mb: Annotated[float, Field(ge=0)]
    """Activation memory (MiB) a micro-batch may keep on the device. A micro-batch whose estimated saved
    activations (its tokens × the bytes per token calibrated on the first micro-batch) fit is left alone;
    a longer one offloads its first saved tensors (the first layers', alive longest) until the rest fits.
    0: offload everything the mode allows. Required; at least 0."""

    mode: Literal["all", "checkpoint_inputs"] = "all"
    """Which saved tensors may go to the host: "all" (every saved activation; never parameters or ZeRO-3's
    gathered parameter buffers) or "checkpoint_inputs" (only the inputs saved by activation checkpointing's
    reentrant CheckpointFunction, torch's or DeepSpeed's, as ALST does). Default "all"."""


class TimelineConfig(BaseModel):
    """Every rank's busy/idle spans of chosen steps, written as a Chrome / Perfetto trace (docs/metrics.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    path: Annotated[str, Field(min_length=1)]
    """The trace file rank 0 writes (JSON, the format PyTorch's profiler writes: open it in Perfetto or
    chrome://tracing; ``python -m ds_odc timeline PATH -o timeline.png`` draws it). Its directory is created.
    Rewritten after each chosen step, so it always holds the chosen steps run so far. Required."""

    steps: Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=1, max_length=64)]
    """The optimizer steps to record, as ``engine.global_steps`` counts them after each step (the first step is
    1; the Trainer's ``global_step`` and the monitor's x-axis count the same). Each chosen step costs one gather of
    every rank's spans to rank 0 after it (``torch.distributed``, not an ODC round). Required; 1 to 64 steps."""
