"""A packed micro-batch cut into the slices of a sequence-parallel group: pure data, beside the plans that
say which rank takes which slice (:mod:`ds_odc.balance.split_plan`; fixed SP:
:mod:`ds_odc.integration.hf_sequence_parallel`).

ALST's rules: ``labels`` become ``shift_labels`` before slicing (so a slice boundary loses no label), every
``[batch, sequence]`` tensor is cut into equal contiguous slices, and ``position_ids`` are sliced too, so RoPE
sees each token's global position and the attention can find where packed samples start.
"""
from __future__ import annotations

import torch

from ds_odc.errors import ODCConfigError

IGNORE_INDEX = -100


def shard_for_sequence_parallel(batch: dict, sp_rank: int, sp_size: int) -> dict:
    """This SP rank's contiguous slice of every ``[batch, seq, ...]`` tensor of ``batch``; ``labels`` become
    ``shift_labels`` (shifted before slicing, so the slice boundaries lose no label), which HF's SP loss reads."""
    if "position_ids" not in batch:
        raise ODCConfigError("sequence parallelism needs position_ids in every collated batch (each token keeps its "
                             "global position once the sequence is sliced): add them in the data collator")
    batch = dict(batch)
    length = batch["input_ids"].shape[1]
    if length % sp_size:
        raise ODCConfigError(f"a micro-batch of sequence length {length} cannot be cut into sp_size={sp_size} equal "
                             "slices: pad to a multiple of sp_size (e.g. the collator's pad_to_multiple_of)")
    if "labels" in batch:
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    chunk = length // sp_size
    for key, value in batch.items():
        if torch.is_tensor(value) and value.dim() >= 2:
            if value.shape[1] != length:
                raise ODCConfigError(f"{key} has shape {tuple(value.shape)}, input_ids {length} tokens: every "
                                     "[batch, sequence] tensor must have input_ids' sequence length")
            batch[key] = value[:, chunk * sp_rank:chunk * (sp_rank + 1)].contiguous()
    return batch


def split_batch(batch: dict, entry, rank: int, pad_token_id: int = 0) -> dict:
    """This rank's slice of a collated, packed micro-batch (``input_ids`` of shape ``[1, tokens]``) for ``entry``.

    A whole entry: ``labels`` become ``shift_labels`` (shifted, the last token of each sequence without a label),
    nothing is cut. A split one: the same, then padded to a multiple of the group (padding tokens continue the last
    sample's positions and have no label, so they change no other token's attention nor the loss), then cut into
    the group's equal slices, slice ``entry.part(rank)`` kept (ALST's rules: labels shifted before slicing,
    ``position_ids`` sliced, so RoPE sees global positions). Either way the loss is the sum over ``shift_labels``
    and its token count ``(shift_labels != -100).sum()``, and the slices' counts add up to the micro-batch's."""
    size = len(entry.ranks)
    if size == 1:
        return shard_for_sequence_parallel(batch, 0, 1)
    length = batch["input_ids"].shape[1]
    pad = -length % size
    if pad:
        batch = dict(batch)
        for key, value in list(batch.items()):
            if not torch.is_tensor(value) or value.dim() < 2:
                continue
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, pad + 1, dtype=value.dtype, device=value.device)
            else:
                fill = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "input_ids": pad_token_id}.get(key, 0)
                tail = torch.full((value.shape[0], pad, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
            batch[key] = torch.cat([value, tail], dim=1)
    return shard_for_sequence_parallel(batch, entry.part(rank), size)
