"""The table of every private name of DeepSpeed, torch, accelerate and transformers that ds_odc relies on
(:data:`SURFACE`; which releases have which form: :data:`CHANGES`; names only one feature needs: :data:`FEATURES`),
and of every process-wide effect ds_odc has (:data:`PROCESS_WIDE`). Data only:
:mod:`ds_odc.integration.surface` checks the names and explains what each check proves.

The one place that assembles the table, and that every name of it is imported from
(``from ds_odc.integration.surface_table import X``). Its parts, one concern each:

* :mod:`~ds_odc.integration.surface_types`: what an entry is (:class:`PrivateName`, :class:`Kind`,
  :class:`Change`, :class:`Feature`, :class:`ProcessWide`) and the ds_odc files the entries name;
* :mod:`~ds_odc.integration.surface_releases`: the release series (:data:`CHANGES`, :data:`FEATURES`);
* :mod:`~ds_odc.integration.surface_deepspeed`: DeepSpeed's and torch's names (:data:`DEEPSPEED_SURFACE`);
* :mod:`~ds_odc.integration.surface_hf`: accelerate's and transformers' names (:data:`HF_SURFACE`,
  :data:`OPTIONAL_PACKAGES`);
* :mod:`~ds_odc.integration.surface_process_wide`: :data:`PROCESS_WIDE`.

A private name newly used under ``ds_odc/`` gets an entry in the part of its owner."""
from __future__ import annotations

from ds_odc.integration.surface_deepspeed import DEEPSPEED_SURFACE
from ds_odc.integration.surface_hf import HF_SURFACE, OPTIONAL_PACKAGES
from ds_odc.integration.surface_process_wide import PROCESS_WIDE
from ds_odc.integration.surface_releases import (
    ACCELERATE_ULYSSES_LOADER,
    ALL_TO_ALL_GROUPS,
    CHANGES,
    CHECKPOINT_STATE,
    COALESCE_GRAD_REDUCTION,
    FEATURES,
    IPG_BUCKET_GROUP,
    LOAD_DS_CONFIG,
    MANAGED_ACCUMULATION,
    NORM_DTYPE,
    SPLIT_POLICY,
    TORCH_STYLE_BACKWARD,
    TRAINER_RUN_EPOCH,
    TRAINER_SEQUENCE_PARALLEL,
    ULYSSES_CORE_ATTN,
    ULYSSES_VARIABLE_LENGTH,
)
from ds_odc.integration.surface_types import Change, Feature, Kind, PrivateName, ProcessWide

#: Every entry: DeepSpeed's and torch's, then accelerate's and transformers'.
SURFACE: tuple[PrivateName, ...] = DEEPSPEED_SURFACE + HF_SURFACE

__all__ = ["SURFACE", "DEEPSPEED_SURFACE", "HF_SURFACE", "OPTIONAL_PACKAGES", "PROCESS_WIDE", "CHANGES", "FEATURES",
           "Change", "Feature", "Kind", "PrivateName", "ProcessWide",
           # the changes (surface_releases.CHANGES) and the features (FEATURES), by their constants
           "ACCELERATE_ULYSSES_LOADER", "ALL_TO_ALL_GROUPS", "CHECKPOINT_STATE", "COALESCE_GRAD_REDUCTION",
           "IPG_BUCKET_GROUP", "LOAD_DS_CONFIG", "MANAGED_ACCUMULATION", "NORM_DTYPE", "TORCH_STYLE_BACKWARD",
           "TRAINER_RUN_EPOCH", "TRAINER_SEQUENCE_PARALLEL", "ULYSSES_CORE_ATTN", "ULYSSES_VARIABLE_LENGTH",
           "SPLIT_POLICY"]
