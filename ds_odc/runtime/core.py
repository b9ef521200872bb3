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
from ds_odc.comm.remote import RemoteWindows
from ds_odc.comm.replica_link import ReplicaBlocks
from ds_odc.comm.schedule import point
from ds_odc.comm.transport import Transport
from ds_odc.runtime import exact_sum
from ds_odc.runtime.cross_node_plan import CrossNodeChoice, with_global_sharding
from ds_odc.runtime.layout import ShardSlot, WindowLayout, owner_slices
from ds_odc.runtime.ledger import FENCE_WIDTH, LossNormalization, MicroBatchLedger, StepTotals
from ds_odc.runtime.lockstep import SequenceParallelLockstep
from ds_odc.runtime.replica_layout import BudgetLayout
from ds_odc.runtime.round_kinds import RoundKind
from ds_odc.runtime.split_lockstep import SplitLockstep
from ds_odc.runtime.step import Phase, StepProtocol
from ds_odc.runtime.step_update import GlobalNorms, StepUpdate

#: How long :meth:`ODCRuntime.close` waits for every peer on other nodes to close too (global sharding).
REMOTE_CLOSE_WAIT_S = 2.0
#: The most values :meth:`ODCRuntime.exchange_values` carries in one round.
VALUES_WIDTH = 8


class ODCRuntime:
    """Pull / push / step for one data-parallel group."""

    def __init__(self, transport: Transport, layout: WindowLayout, ledger: MicroBatchLedger,
                 on_open: Optional[Callable[[], None]] = None, link: Optional[CrossNodeLink] = None,
                 exact: bool = False, remote: Optional[RemoteWindows] = None, job_world: Optional[int] = None,
                 on_gradients_moved: Optional[Callable[[], None]] = None):
        self.transport = transport
        self.layout = layout
        self.ledger = ledger
        self.link = link or CrossNodeLink()
        # owners on other nodes: reached through ``remote`` (cross_node "global", one block per rank; "budget": the
        # same, but the replicated layers' shards are in this node's replica slots), or their blocks are in this
        # node's windows (replicate: a block per node)
        self.remote = remote
        blocks = 1 if remote is not None else self.link.node_count
        if blocks != layout.node_count:
            raise ValueError(f"a layout of {layout.node_count} node blocks with a link to {self.link.node_count} nodes"
                             + (" and global sharding" if remote is not None else ""))
        self.node = self.link.node  # this rank's node: its own shards are that node's block
        # ZeRO-3's partitions: one per rank of the job
        self.world_size = job_world or transport.world_size * self.link.node_count
        self._block_of = (lambda node: 0) if remote is not None else (lambda node: node)
        self.own_block = self._block_of(self.node)  # where this rank's own shards sit in its windows
        self.protocol = StepProtocol(transport, ledger, on_open, self.link, layout.blocks, exact,
                                     own_trainable=layout.trainable_block(self.own_block),
                                     on_gradients_moved=on_gradients_moved)
        self.exact = exact  # deterministic accumulation: coarse and fine regions ([Note: exact sums])
        self.warned_inexact = False
        self.cross_node: Optional[CrossNodeChoice] = None  # how a job on several nodes holds its windows (open_session)
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
        point("pull")
        self._read([Transfer(owner, offset, out.narrow(0, start, count))
                    for owner, offset, start, count in self._param_pieces(key)]).wait()
        point("pull.done")
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
        point("pull")
        reads = [Transfer(owner, offset, out.narrow(0, start, count))
                 for key, out in zip(keys, outs) for owner, offset, start, count in self._param_pieces(key)]
        handle = self._read(reads)
        point("pull.done")
        self.pulls += len(keys)
        self.transport.heartbeat()
        return handle

    # -- this rank's own shards (its node's block) ---------------------------------------------------
    # Views of this rank's own windows: of the transport's, or of their host copies while they are away
    # (offload_windows); gradients, while a read between backward and step lasts, of the copy it took ([Note:
    # reads are snapshots]). ZeRO-3's buffers are pointed at these either way.
    def own_shard(self, key: int) -> torch.Tensor:
        """This rank's shard of parameter ``key`` in its window (what its optimizer updates)."""
        slot = self.layout.slots[key]
        return self.protocol.residency.stash.window("params").narrow(0, self.layout.param_offset(slot, self.own_block),
                                                           slot.shard_numel)

    def own_gradient(self, key: int) -> torch.Tensor:
        """This rank's gradient shard of trainable parameter ``key`` in its accumulator."""
        slot = self.layout.slots[key]
        return self._gradients().narrow(0, self.layout.grad_offset(slot, self.own_block), slot.shard_numel)

    def own_trainable_shards(self) -> torch.Tensor:
        """This rank's trainable shards, contiguous in its window (ZeRO-3's flat shard buffer lives here)."""
        return self.protocol.residency.stash.window("params").narrow(0, *self.layout.trainable_block(self.own_block))

    def own_gradients(self) -> torch.Tensor:
        """This rank's gradient shards, contiguous in its accumulator (ZeRO-3's gradient partition)."""
        return self._gradients().narrow(0, *self.layout.trainable_block(self.own_block))

    def _gradients(self) -> torch.Tensor:
        snapshot = self.protocol.snapshot
        return snapshot.copy if snapshot is not None else self.protocol.residency.stash.window("grads")

    def _param_pieces(self, key: int):
        """``(owner, window offset, start, count)`` of every owner's (job rank's) shard of ``key``."""
        slot = self.layout.slots[key]
        for owner, start, count in owner_slices(slot.numel, slot.shard_numel, self.world_size):
            holder, offset = self._place(key, slot, owner, gradient=False)
            yield holder, offset, start, count

    def _place(self, key: int, slot: ShardSlot, owner: int, gradient: bool) -> tuple[int, int]:
        """``(job rank, offset)`` where ``owner``'s shard of ``key`` (its gradient shard, with ``gradient``) is read
        or added: the owner's block (its own, its node's copy under replicate, or its own across nodes under global
        sharding), or for a replicated layer of an owner on another node (cross_node "budget") the replica slot of
        this node's rank with the owner's local rank (:mod:`ds_odc.runtime.replica_layout`)."""
        node, local = divmod(owner, self.transport.world_size)
        if node != self.node and key in self.layout.replicated:
            layout = self.layout
            assert isinstance(layout, BudgetLayout)
            index = ReplicaBlocks.slot_of(node, self.node)
            offset = layout.replica_grad_offset(key, index) if gradient else layout.replica_param_offset(key, index)
            return self.node * self.transport.world_size + local, offset
        block = self._block_of(node)
        return owner, self.layout.grad_offset(slot, block) if gradient else self.layout.param_offset(slot, block)

    def _routed(self, transfers: Sequence[Transfer]) -> tuple[list[Transfer], list[Transfer]]:
        """``transfers`` (owners are job ranks) split into those for this node's transport (the owner, or
        with replicated blocks the node's rank holding the owner's block: addressed by local rank) and those
        for owners on other nodes (global sharding: addressed by job rank)."""
        local, remote = [], []
        for transfer in transfers:
            node, rank = divmod(transfer.owner, self.transport.world_size)
            if self.remote is not None and node != self.node:
                remote.append(transfer)
            else:
                local.append(Transfer(rank, transfer.offset, transfer.tensor))
        return local, remote

    def _read(self, reads: Sequence[Transfer]) -> Completion:
        local, remote = self._routed(reads)
        if remote:
            assert self.remote is not None
            with self.protocol.failing_group("a parameter pull from another node"):
                self.remote.read_many(remote)
        return self.transport.read_many(local)

    def push(self, key: int, grad: torch.Tensor) -> None:
        """Add the full flat gradient of parameter ``key``, divided by the world size, into its
        owners' accumulators. ``grad`` is consumed: it is divided in place.

        Dividing on the way in keeps each accumulator equal to ZeRO-3's gradient partition (the
        reduce-scatter's average) at every moment, so ZeRO-3's gradient reads and writes between
        backward and step keep their meaning; the step applies the rest of the normalisation."""
        self.protocol.before_push()
        point("push")
        slot = self.layout.slots[key]
        with self.protocol.failing_group("a gradient push"):
            if slot.grad_offset is None:
                raise RuntimeError(f"parameter {key} is frozen but produced a gradient")
            if grad.numel() != slot.numel:
                raise ValueError(f"gradient of parameter {key} has {grad.numel()} elements, expected {slot.numel}")
            if self.world_size > 1:
                grad.div_(self.world_size)
            parts = [grad] if not self.exact else self._exact_parts(key, grad)
            pushes = []
            for owner, start, count in owner_slices(slot.numel, slot.shard_numel, self.world_size):
                holder, offset = self._place(key, slot, owner, gradient=True)
                for region, part in enumerate(parts):  # exact sums: the fine part in the second region
                    pushes.append(Transfer(holder, offset + region * self.layout.accumulator_numel,
                                           part.narrow(0, start, count)))
            local, remote = self._routed(pushes)
            for push in local:
                self.transport.accumulate(push.owner, push.offset, push.tensor)
            if remote:
                assert self.remote is not None
                self.remote.accumulate_many(remote)
        point("push.done")
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
        self.refuse_with_global_sharding(what)
        if "grads" in kinds and self.protocol.snapshot is not None:
            with self.protocol.failing_group(what):
                self.protocol.end_read()  # a reader's writes go with the accumulator
        return self.protocol.residency.offload(frozenset(kinds), pin_memory, non_blocking, what)

    def reload_windows(self, non_blocking: bool = False, what: str = "engine.reload_states()") -> frozenset:
        """Bring every window that is away back, with every rank (collective). Returns the kinds brought back."""
        return self.protocol.residency.reload(non_blocking, what)

    @property
    def windows_away(self) -> frozenset:
        """The kinds of this rank's windows now in host memory (``engine.offload_states``)."""
        return self.protocol.residency.away

    def sync_gradients(self, what: str) -> bool:
        """A gradient read's fence outside a step (collective): every rank's pushes so far have landed, and this
        rank's gradient views (:meth:`own_gradients`) are a copy of them until its next push or step ([Note: reads
        are snapshots]). Returns whether the copy is new (the views moved)."""
        return self.protocol.sync_gradients(what)

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
        self.refuse_with_global_sharding("sequence parallelism")
        return SequenceParallelLockstep(self.protocol, group, members, timeout_s)

    def split_lockstep(self, timeout_s: float) -> SplitLockstep:
        """The lockstep of split micro-batches (policy "lb-mini-split"): their members begin the same forwards."""
        self.refuse_with_global_sharding('the balance policy "lb-mini-split"')
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

    def refuse_with_global_sharding(self, what: str) -> None:
        """What is not yet tested with owners on other nodes is refused by name (the same on every rank: every
        rank has the same options), before any round."""
        if self.remote is not None:
            raise with_global_sharding(what, self.cross_node.mode if self.cross_node is not None else "global")

    def close(self) -> None:
        try:
            self.protocol.close()
            if self.remote is None or self.remote.close(wait_s=REMOTE_CLOSE_WAIT_S):
                self.transport.close()
            else:  # peers on other nodes may still read this rank's window: it stays until they all closed
                self.transport.say_closed()
                self.remote.after_serving(self.transport.close)
        finally:
            self.link.close()
