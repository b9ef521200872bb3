"""The ODC runtime: one-sided pulls and pushes, and the step protocol, on top of any :class:`Transport`.

It knows parameters only as keys into a :class:`WindowLayout`; it knows nothing of DeepSpeed
(``ds_odc.integration`` adapts ZeRO-3 to it) nor of which transport it drives. Everything ranks
do together belongs to :class:`~ds_odc.runtime.step.StepProtocol`; a pull or push only asks it
whether the phase allows one, and a failed push poisons the group through it (a partial push
leaves owners' accumulators with partial sums: the step could never be right).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Optional, Sequence

import torch

from ds_odc.comm.batch import Completion, Transfer
from ds_odc.comm.cross_node import CrossNodeLink
from ds_odc.comm.transport import Transport
from ds_odc.runtime import exact_sum
from ds_odc.runtime.layout import WindowLayout, owner_slices
from ds_odc.runtime.ledger import FENCE_WIDTH, LossNormalization, MicroBatchLedger, StepTotals
from ds_odc.runtime.lockstep import SequenceParallelLockstep
from ds_odc.runtime.round_kinds import RoundKind
from ds_odc.runtime.split_lockstep import SplitLockstep
from ds_odc.runtime.step import GlobalNorms, Phase, StepProtocol, StepUpdate

#: The most values :meth:`ODCRuntime.exchange_values` carries in one round.
VALUES_WIDTH = 8


class ODCRuntime:
    """Pull / push / step for one data-parallel group."""

    def __init__(self, transport: Transport, layout: WindowLayout, ledger: MicroBatchLedger,
                 on_open: Optional[Callable[[], None]] = None, link: Optional[CrossNodeLink] = None,
                 exact: bool = False):
        self.transport = transport
        self.layout = layout
        self.ledger = ledger
        self.link = link or CrossNodeLink()
        if self.link.node_count != layout.node_count:
            raise ValueError(f"a layout of {layout.node_count} node blocks with a link to "
                             f"{self.link.node_count} nodes")
        self.node = self.link.node  # this rank's node: its own shards are that node's block
        self.world_size = transport.world_size * layout.node_count  # ZeRO-3's partitions: one per rank of the job
        self.protocol = StepProtocol(transport, ledger, on_open, self.link, layout.blocks, exact)
        self.exact = exact  # deterministic accumulation: coarse and fine regions ([Note: exact sums])
        self.warned_inexact = False
        self.pulls = 0  # parameters pulled, for tests and metrics
        self.pushes = 0  # gradients pushed

    @staticmethod
    def exchange_width(num_norm_groups: int) -> int:
        """Values a round must carry: the fence's counts, one squared norm per norm group, or the values
        of an exchange between steps."""
        return max(FENCE_WIDTH, num_norm_groups, VALUES_WIDTH)

    @property
    def phase(self) -> Phase:
        return self.protocol.phase

    @property
    def last_totals(self) -> Optional[StepTotals]:
        return self.protocol.last_totals

    # -- forward / backward: one-sided, no peer takes part -----------------------------------------
    def pull(self, key: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (flat, ``numel`` elements, compute dtype) with the full parameter ``key``,
        reading each owner's shard from its window."""
        self.protocol.before_pull()
        for local, offset, start, count in self._param_pieces(key):
            self.transport.read(local, offset, out.narrow(0, start, count))
        self.pulls += 1
        self.transport.heartbeat()
        return out

    def pull_many(self, keys: Sequence[int], outs: Sequence[torch.Tensor]) -> Completion:
        """:meth:`pull` of several parameters (a module's) in one transport call: every owner's shard
        of every ``keys[i]`` into ``outs[i]``. Returns the transport's handle; ``outs`` are valid after
        its ``wait()``. One phase check and one heartbeat for the batch instead of one per parameter."""
        if len(keys) != len(outs):
            raise ValueError(f"pull_many: {len(keys)} keys but {len(outs)} destinations")
        self.protocol.before_pull()
        reads = []
        for key, out in zip(keys, outs):
            for local, offset, start, count in self._param_pieces(key):
                reads.append(Transfer(local, offset, out.narrow(0, start, count)))
        handle = self.transport.read_many(reads)
        self.pulls += len(keys)
        self.transport.heartbeat()
        return handle

    # -- this rank's own shards (its node's block) ---------------------------------------------------
    # Views of this rank's own windows: of the transport's, or of their host copies while they are away
    # (offload_windows): ZeRO-3's buffers are pointed at these either way.
    def own_shard(self, key: int) -> torch.Tensor:
        """This rank's shard of parameter ``key`` in its window (what its optimizer updates)."""
        slot = self.layout.slots[key]
        return self.protocol.residency.stash.window("params").narrow(0, self.layout.param_offset(slot, self.node),
                                                           slot.shard_numel)

    def own_gradient(self, key: int) -> torch.Tensor:
        """This rank's gradient shard of trainable parameter ``key`` in its accumulator."""
        slot = self.layout.slots[key]
        return self.protocol.residency.stash.window("grads").narrow(0, self.layout.grad_offset(slot, self.node),
                                                          slot.shard_numel)

    def own_trainable_shards(self) -> torch.Tensor:
        """This rank's trainable shards, contiguous in its window (ZeRO-3's flat shard buffer lives here)."""
        return self.protocol.residency.stash.window("params").narrow(0, *self.layout.trainable_block(self.node))

    def own_gradients(self) -> torch.Tensor:
        """This rank's gradient shards, contiguous in its accumulator (ZeRO-3's gradient partition)."""
        return self.protocol.residency.stash.window("grads").narrow(0, *self.layout.trainable_block(self.node))

    def _param_pieces(self, key: int):
        """``(rank on this node, window offset, start, count)`` of every owner's shard of ``key``: the
        owner itself on one node; on several, the node's rank holding that owner's block."""
        slot = self.layout.slots[key]
        for owner, start, count in owner_slices(slot.numel, slot.shard_numel, self.world_size):
            node, local = divmod(owner, self.transport.world_size)
            yield local, self.layout.param_offset(slot, node), start, count

    def push(self, key: int, grad: torch.Tensor) -> None:
        """Add the full flat gradient of parameter ``key``, divided by the world size, into its
        owners' accumulators. ``grad`` is consumed: it is divided in place.

        Dividing on the way in keeps each accumulator equal to ZeRO-3's gradient partition (the
        reduce-scatter's average) at every moment, so ZeRO-3's gradient reads and writes between
        backward and step keep their meaning; the step applies the rest of the normalisation."""
        self.protocol.before_push()
        slot = self.layout.slots[key]
        with self.protocol.failing_group("a gradient push"):
            if slot.grad_offset is None:
                raise RuntimeError(f"parameter {key} is frozen but produced a gradient")
            if grad.numel() != slot.numel:
                raise ValueError(f"gradient of parameter {key} has {grad.numel()} elements, expected {slot.numel}")
            if self.world_size > 1:
                grad.div_(self.world_size)
            parts = [grad] if not self.exact else self._exact_parts(key, grad)
            for owner, start, count in owner_slices(slot.numel, slot.shard_numel, self.world_size):
                node, local = divmod(owner, self.transport.world_size)
                offset = self.layout.grad_offset(slot, node)
                for region, part in enumerate(parts):  # exact sums: the fine part in the second region
                    self.transport.accumulate(local, offset + region * self.layout.accumulator_numel,
                                              part.narrow(0, start, count))
        self.pushes += 1
        self.transport.heartbeat()

    def _exact_parts(self, key: int, grad: torch.Tensor) -> list[torch.Tensor]:
        coarse, fine = exact_sum.split(grad)
        if not self.warned_inexact and exact_sum.beyond_exact_range(coarse):
            self.warned_inexact = True
            largest = float(grad.abs().max())
            logging.getLogger("ds_odc").warning(
                f"ds_odc deterministic accumulation: a gradient of parameter {key} reaches {largest:.3g} (after the "
                f"division by the world size), beyond the range summed exactly ({exact_sum.COARSE_LIMIT:.3g}): its "
                "sums may round differently from run to run (said once)")
        return [coarse, fine]

    def record_micro_batch(self, rule: LossNormalization, tokens: int = 0, shared: bool = False) -> None:
        """One backward finished on this rank, under ``rule`` (see :mod:`ds_odc.runtime.ledger`); ``shared``:
        as a member of a split micro-batch other than its first."""
        self.protocol.record_micro_batch(rule, tokens, shared)

    # -- together --------------------------------------------------------------------------------------
    def step(self, update: StepUpdate) -> StepTotals:
        """The optimizer step: fence, norm, ``update``, publish (see :mod:`ds_odc.runtime.step`)."""
        return self.protocol.step(update)

    def open(self) -> None:
        """The open round now rather than at the first pull, push or round (see :meth:`StepProtocol.open`)."""
        self.protocol.open()

    def windows_rewritten(self, what: str) -> None:
        """Every rank rewrote its own shards outside a step (a checkpoint load, GatheredParameters):
        meet, so that no rank pulls before every owner has finished writing."""
        self.protocol.meet(RoundKind.WINDOWS_REWRITTEN, what)

    def offload_windows(self, kinds, pin_memory: bool = True, non_blocking: bool = False,
                        what: str = "engine.offload_states()") -> frozenset:
        """Move this rank's windows of ``kinds`` ("params", "grads") to host memory, with every rank
        (collective; :mod:`ds_odc.runtime.residency`). Returns the kinds moved now."""
        return self.protocol.residency.offload(frozenset(kinds), pin_memory, non_blocking, what)

    def reload_windows(self, non_blocking: bool = False, what: str = "engine.reload_states()") -> frozenset:
        """Bring every window that is away back, with every rank (collective). Returns the kinds brought back."""
        return self.protocol.residency.reload(non_blocking, what)

    @property
    def windows_away(self) -> frozenset:
        """The kinds of this rank's windows now in host memory (``engine.offload_states``)."""
        return self.protocol.residency.away

    def sync_gradients(self, what: str) -> None:
        """A gradient fence outside a step (collective): every rank's pushes so far have landed."""
        self.protocol.sync_gradients(what)

    def gradient_norms(self, squared: torch.Tensor, what: str) -> GlobalNorms:
        """Every owner's per-group squared gradient norms (of its accumulator as it is now: call after
        :meth:`sync_gradients`) summed over the job, outside a step (collective)."""
        return self.protocol.norms_outside_step(squared, what)

    def discard_gradients(self, what: str) -> None:
        """Drop every rank's gradients since the last step (collective; ``optimizer.zero_grad()``)."""
        self.protocol.discard_gradients(what)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around a checkpoint save: peers' errors say this rank is saving, and a failure inside fails the group."""
        with self.protocol.saving():
            yield

    def sequence_parallel_lockstep(self, group: int, members: Sequence[int], timeout_s: float
                                   ) -> SequenceParallelLockstep:
        """The lockstep of SP group ``group`` (job ranks ``members``): its ranks begin the same forwards."""
        return SequenceParallelLockstep(self.protocol, group, members, timeout_s)

    def split_lockstep(self, timeout_s: float) -> SplitLockstep:
        """The lockstep of split micro-batches (policy "lb-mini-split"): their members begin the same forwards."""
        return SplitLockstep(self.protocol, timeout_s)

    def barrier(self, what: str) -> None:
        """A barrier that fails fast, naming the rank, when a peer fails, dies or stalls."""
        self.protocol.meet(RoundKind.BARRIER, what)

    def fail(self, err: BaseException, where: str) -> None:
        """Poison the group: ``err`` at ``where`` left state that no retry can repair."""
        self.protocol.fail(err, where)

    def exchange_values(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's ``values`` (1-D, at most the rounds' width), one row per rank of the job, outside
        a step (collective). For the few numbers a framework needs from every rank between steps (the
        Trainer's loss-token count, its logged metrics): a round, so a dead or stuck peer is named within
        ``timeout_s`` instead of leaving the others in a collective until the process group's timeout."""
        values = values.detach().reshape(-1).to("cpu", torch.float64)
        if values.numel() > VALUES_WIDTH:
            raise ValueError(f"exchange_values carries at most {VALUES_WIDTH} values, got {values.numel()} ({what})")
        rows = self.protocol.meet(RoundKind.VALUES, what, values)
        with self.protocol.failing_group(what):
            return self.link.job_rows(rows)

    def close(self) -> None:
        try:
            self.protocol.close()
            self.transport.close()
        finally:
            self.link.close()
