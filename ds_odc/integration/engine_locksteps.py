"""Which lockstep an ODC engine's forwards take: set up when its optimizer is built, torn down at ``destroy()``.

Two features make ranks meet inside forwards, and each brings its lockstep (the check, before a forward, that the
ranks about to meet in all-to-alls run the same forward):

* fixed sequence parallelism (ALST's ``mpu``): the ranks of one SP group run the same micro-batches
  (:class:`~ds_odc.runtime.lockstep.SequenceParallelLockstep`, :mod:`ds_odc.integration.sequence_parallel`);
* the split policy (``balance.policy "lb-mini-split"``): the members of each split micro-batch
  (:mod:`ds_odc.integration.split_attention`). The two cannot go together: refused by name.

A frozen engine (a reference model) has none of its own: its forwards take the newest training engine's, whose
attention hook they go through too.
"""
from __future__ import annotations

from typing import Optional

from ds_odc.balance.split_plan import SPLIT_POLICY
from ds_odc.errors import ODCConfigError
from ds_odc.integration import sequence_parallel, split_attention
from ds_odc.runtime.lockstep import SequenceParallelLockstep


def attach(engine, optimizer, balance, timeout_s: float
           ) -> tuple[Optional[SequenceParallelLockstep], Optional[split_attention.SplitRuntime]]:
    """A training engine's fixed-SP lockstep (under an SP ``mpu``) or split runtime (under the split policy),
    registered as the process's newest; collective where the split policy creates its groups. ``optimizer``: the
    ODC optimizer DeepSpeed just built, destroyed here when this refuses or fails: the engine's own cleanup cannot
    see it yet (``engine.optimizer`` is set after), and its windows and mappings of every peer's would stay."""
    try:
        return _attach(engine, optimizer.odc, balance, timeout_s)
    except BaseException:
        optimizer.destroy()
        raise


def _attach(engine, runtime, balance, timeout_s: float
            ) -> tuple[Optional[SequenceParallelLockstep], Optional[split_attention.SplitRuntime]]:
    lockstep = sequence_parallel.lockstep_for(engine, runtime, timeout_s)
    if lockstep is not None:
        sequence_parallel.refuse_lost_windows(engine.module)
        sequence_parallel.register(lockstep)
    if balance is None or balance.policy != SPLIT_POLICY:
        return lockstep, None
    if lockstep is not None:
        sequence_parallel.unregister(lockstep)
        raise ODCConfigError("balance policy 'lb-mini-split' chooses its sequence-parallel groups per "
                             "micro-batch: leave the fixed SP mpu (ALST's, accelerate's sp_size) out")
    split = split_attention.enable(engine, runtime, balance, timeout_s)
    sequence_parallel.register(split.lockstep)
    return None, split


def detach(lockstep: Optional[SequenceParallelLockstep], split: Optional[split_attention.SplitRuntime]) -> None:
    """Unregister an engine's lockstep; close its split runtime (the attention entry back, its groups destroyed)."""
    sequence_parallel.unregister(lockstep)
    if split is not None:
        sequence_parallel.unregister(split.lockstep)
        split.close()


def lockstep_of(frozen: bool, lockstep: Optional[SequenceParallelLockstep],
                split: Optional[split_attention.SplitRuntime]) -> Optional[sequence_parallel.Lockstep]:
    """The lockstep an engine's forwards take: a training engine's own, a frozen engine the newest training one's."""
    if frozen:
        return sequence_parallel.process_lockstep()
    return split.lockstep if split is not None else lockstep


def before_forward(lockstep: Optional[sequence_parallel.Lockstep], split: Optional[split_attention.SplitRuntime],
                   module, kwargs: dict, training: bool) -> None:
    """What an engine's forward does before DeepSpeed's: under fixed SP the positions ALST cannot keep apart are
    refused, then the lockstep; inside a split micro-batch, the forward noted for its backward."""
    if isinstance(lockstep, SequenceParallelLockstep):
        sequence_parallel.refuse_lost_positions(lockstep, module, kwargs)
    if lockstep is not None:
        lockstep.before_forward()
    if split is not None:
        split.note_forward(training)
