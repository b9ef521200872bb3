"""Ulysses sequence parallelism (DeepSpeed ALST) on the odc stage: where the SP groups come from.

ALST's ``UlyssesSPAttentionHF.register_with_transformers`` (and accelerate's ``ParallelismConfig(sp_size=…,
sp_backend="deepspeed")``, which calls it) builds SP groups of contiguous ranks and hands
``deepspeed.initialize`` an ``mpu``. DeepSpeed then partitions ZeRO-3 over the sequence-data-parallel
group, the whole world, and so does the odc stage: every rank pulls and pushes over the world, each SP
rank pushing its partial gradient, which the owners' accumulators sum. What ODC adds is the lockstep of
:mod:`ds_odc.runtime.lockstep` (the ranks of one SP group run the same micro-batches) and counting
samples per SP group. ALST replaces the attention function process-wide, so a frozen model's forward (a
DPO reference model's) meets the SP peers in all-to-alls as well: it takes the lockstep of the newest
training engine of the process (:func:`process_lockstep`). The other route, ``sequence_parallel_size`` in the
ds_config without an ``mpu``, is refused by :mod:`ds_odc.config` (it partitions ZeRO-3 over the data-parallel
mesh only).
"""
from __future__ import annotations

from typing import Optional, Union

import torch.distributed as tdist

from ds_odc.runtime import ODCRuntime
from ds_odc.runtime.lockstep import SequenceParallelLockstep
from ds_odc.runtime.split_lockstep import SplitLockstep

#: A training engine's lockstep: fixed SP's, or the split micro-batches' (:mod:`ds_odc.integration.split_attention`).
Lockstep = Union[SequenceParallelLockstep, SplitLockstep]


def sequence_parallel_size(engine) -> int:
    """The SP group size DeepSpeed found (1 without sequence parallelism)."""
    return int(getattr(engine, "sequence_parallel_size", 1) or 1)


def lockstep_for(engine, runtime: ODCRuntime, timeout_s: float) -> Optional[SequenceParallelLockstep]:
    """The SP lockstep of a training engine whose ``mpu`` has SP groups (None without); ``runtime``: its
    optimizer's ODC runtime."""
    size = sequence_parallel_size(engine)
    if size <= 1:
        return None
    members = sorted(tdist.get_process_group_ranks(engine.seq_parallel_group))
    return runtime.sequence_parallel_lockstep(members[0] // size, members, timeout_s)


_training_locksteps: list[Lockstep] = []  # of this process's training engines, newest last


def register(lockstep: Lockstep) -> None:
    _training_locksteps.append(lockstep)


def unregister(lockstep: Optional[Lockstep]) -> None:
    if lockstep in _training_locksteps:
        _training_locksteps.remove(lockstep)


def live_split_lockstep() -> Optional[SplitLockstep]:
    """The split lockstep of a live training engine with the split policy in this process, if any (one at most:
    :func:`ds_odc.integration.split_attention.enable` refuses a second)."""
    return next((lockstep for lockstep in _training_locksteps if isinstance(lockstep, SplitLockstep)), None)


def process_lockstep() -> Optional[Lockstep]:
    """The lockstep a frozen engine's forward takes: the newest training engine's (None without SP or split
    micro-batches; a split one's attention hook is process-wide too, so a reference model inside a split
    micro-batch meets its members in all-to-alls)."""
    return _training_locksteps[-1] if _training_locksteps else None
