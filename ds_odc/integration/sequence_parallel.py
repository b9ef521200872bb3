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

ALST runs the model's core attention without its mask ([Note: the mask ALST drops]), so two attention forms
one process honours are lost under it with any implementation but a flash attention: a sliding window (refused at
``initialize``, naming the layers) and samples packed into one sequence, or positions a mask would have hidden
(refused at the forward that has them, before any all-to-all). Both are silent on ZeRO-3.

[Note: the mask ALST drops]
``UlyssesSPAttentionHF.register_with_transformers`` wraps the attention entry in a function that sets
``attention_mask`` to None (a 4-D mask is the local slice's and O(n²)) and hands the gathered ``position_ids`` to
the core attention. A flash attention reads packed samples from ``position_ids`` (varlen) and takes the model's
``sliding_window`` keyword; sdpa then attends causally over the whole gathered sequence (every sample sees the
samples packed before it, every sliding layer sees everything), and flex_attention's block mask is rebuilt plain
causal. Nothing fails: the numbers differ from one process's.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch
import torch.distributed as tdist

from ds_odc.errors import ODCConfigError
from ds_odc.integration.packed_attention import sliding_layers, takes_window_itself, text_config_of
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


def _implementation(module: torch.nn.Module) -> Optional[str]:
    """The attention implementation of the first Hugging Face model in ``module`` (None without one)."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) is not None:
            return str(config._attn_implementation)
    return None


def refuse_lost_windows(module: torch.nn.Module) -> None:
    """At ``initialize`` under fixed SP: a model with sliding-window layers and an attention that cannot take the
    window without the mask ALST drops is refused by name ([Note: the mask ALST drops])."""
    text, implementation = text_config_of(module), _implementation(module)
    sliding = sliding_layers(text) if text is not None else []
    if not sliding or implementation is None or takes_window_itself(implementation):
        return
    layers = "every layer" if len(sliding) == int(getattr(text, "num_hidden_layers", 0) or 0) else \
        "layers " + ", ".join(map(str, sliding))
    raise ODCConfigError(
        f"fixed sequence parallelism (ALST's mpu) would lose the model's sliding window at {layers}: "
        f"sliding_window={getattr(text, 'sliding_window', None)} with attn_implementation={implementation!r}: ALST "
        "runs the attention without the model's mask, so every layer would attend over the whole sequence (as "
        "on ZeRO-3, silently); use a flash attention (it takes the sliding_window keyword), or leave SP out")


#: module -> whether its attention needs the mask ALST drops to tell samples apart (not a flash attention)
_needs_mask: "weakref.WeakKeyDictionary[torch.nn.Module, bool]" = weakref.WeakKeyDictionary()


def refuse_lost_positions(lockstep: SequenceParallelLockstep, module: torch.nn.Module, kwargs: dict[str, Any]
                          ) -> None:
    """Before a forward under fixed SP, before any all-to-all: this rank's ``position_ids`` must count up by one
    along each row, and (beyond the group's first member) not start a sample at the slice's first token, unless the
    attention is a flash attention, which reads samples from them. Else packed samples, or padding a mask would
    have hidden, would attend across each other ([Note: the mask ALST drops]): refused by name, the group
    failed so that every member raises. Without ``position_ids`` ALST raises its own error."""
    needs = _needs_mask.get(module)
    if needs is None:
        implementation = _implementation(module)
        needs = _needs_mask[module] = implementation is not None and not takes_window_itself(implementation)
    positions = kwargs.get("position_ids")
    if not needs or not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[1] == 0:
        return
    index = lockstep.members.index(lockstep.me)
    steps = positions[:, 1:] - positions[:, :-1]
    restarts = bool((steps != 1).any()) or (index > 0 and bool((positions[:, 0] == 0).any()))
    if not restarts:
        return
    with lockstep.protocol.failing_group("the sequence-parallel lockstep (before a forward)"):
        raise ODCConfigError(
            f"rank {lockstep.me} of {lockstep.title}: this forward's position_ids restart or skip (several samples "
            f"packed into one sequence, or padding): with attn_implementation={_implementation(module)!r} ALST runs "
            "the attention without the mask that keeps them apart, so each sample would attend to the ones before it "
            "(as on ZeRO-3, silently); use a flash attention (it reads the samples from position_ids), or one "
            "sample per sequence without padding inside it")
