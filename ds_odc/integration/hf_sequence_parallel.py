"""The balance block under Ulysses sequence parallelism in the Hugging Face Trainer
(``ParallelismConfig(sp_size=N, sp_backend="deepspeed")``).

Without the block, accelerate wraps the Trainer's training loader in ALST's ``UlyssesSPDataLoaderAdapter``:
each rank loads its own batches, and every refill gathers one batch from each rank of the SP group, which
the whole group then runs, each rank on its slice of the sequence. So per optimizer step an SP group runs
the ``gradient_accumulation_steps`` batches its ``N`` ranks loaded, and the ranks of a group always run
the same micro-batches.

With the block, the plan is made per SP group: the step's global samples (the same as without the block,
replayed from accelerate's sharding for every rank) are planned over ``world / N`` groups, and every rank
of group ``g`` yields the same slots of group ``g``'s micro-batches, each micro-batch collated by the
user's collator and then cut to this rank's slice of the sequence (:func:`shard_for_sequence_parallel`, what
the adapter does to a batch). The adapter is not applied to that loader: the Trainer's accelerator answers
:func:`deepspeed_ulysses_dl_adapter` with the loader itself (bound on that accelerator instance only).
"""
from __future__ import annotations

import dataclasses

import torch

from ds_odc.errors import ODCConfigError

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class SequenceParallelPlacement:
    """Where this rank sits: ``size`` ranks per SP group, ``groups`` groups, this rank's ``group`` and its
    ``sp_rank`` inside it (contiguous groups, as ALST builds them)."""

    size: int
    groups: int
    group: int
    sp_rank: int


def placement_of(trainer) -> SequenceParallelPlacement | None:
    """The Trainer's SP placement (None without sequence parallelism)."""
    size = trainer.get_sp_size() if callable(getattr(trainer, "get_sp_size", None)) else 1
    if size <= 1:
        return None
    world, rank = trainer.args.world_size, trainer.args.process_index
    gas = trainer.args.gradient_accumulation_steps
    if gas % size:
        raise ODCConfigError(f"zero_optimization.odc.balance with sequence parallelism (sp_size={size}) needs "
                             f"gradient_accumulation_steps to be a multiple of sp_size (got {gas}): an SP group runs "
                             f"the batches its {size} ranks load, one from each per refill")
    return SequenceParallelPlacement(size, world // size, rank // size, rank % size)


def sharding_collator(collate_fn, placement: SequenceParallelPlacement):
    """``collate_fn`` followed by this rank's slice of the sequence."""

    def collate(samples):
        return shard_for_sequence_parallel(collate_fn(samples), placement.sp_rank, placement.size)

    return collate


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


def keep_planned_loader(trainer, is_planned) -> None:
    """Bind ``deepspeed_ulysses_dl_adapter`` on this Trainer's accelerator: a loader ``is_planned(loader)``
    already yields this rank's slices and stays as it is; any other is wrapped as before."""
    from ds_odc.integration.patching import bind

    def adapter(original, accelerator, dl, *args, **kwargs):
        return dl if is_planned(dl) else original(accelerator, dl, *args, **kwargs)

    import accelerate

    bind(trainer.accelerator, {"deepspeed_ulysses_dl_adapter": adapter},
         needed_for="zero_optimization.odc.balance with sequence parallelism",
         release=f"accelerate {accelerate.__version__}")
