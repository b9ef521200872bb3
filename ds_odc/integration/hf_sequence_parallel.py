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

from ds_odc.balance.slices import shard_for_sequence_parallel
from ds_odc.errors import ODCConfigError


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
