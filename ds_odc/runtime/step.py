"""The step protocol: the one owner of everything ranks do together.

ODC ranks meet only here. One :class:`StepProtocol` per engine drives the whole optimizer step
through typed rendezvous rounds, with an explicit, guarded state machine (drawn in
:mod:`ds_odc.runtime.phases`, with its one transition table).

Rounds of step ``s`` (each carries ``s``, its kind and its length, checked on every rank):

1. **fence**: every rank's pushes have landed; global micro-batch and token counts. Each owner
   then divides its accumulator by the normalisation divisor (:mod:`ds_odc.runtime.ledger`);
2. **norm**: every owner's squared gradient norms, per norm group: one global norm for clipping,
   and whether any gradient is not finite. It runs on every step, whatever the update does with it;
3. the **update** (the engine adapter's :class:`StepUpdate`: e.g. ZeRO-3's optimizer step) writes
   the owner's new shards into its window;
4. **publish**: every owner has written its shards and cleared its accumulator; pulls may resume.

Owners' accumulators hold what ZeRO-3's gradient partitions hold at every moment: the sum over
pushed micro-batches of the gradient divided by the world size (pushes arrive pre-divided, see
:meth:`~ds_odc.runtime.core.ODCRuntime.push`), so the step divides by the normalisation divisor over
the world size, and ZeRO-3's gradient reads between backward and step see ZeRO-3's numbers.

Rounds outside a step, each one collective (every rank calls it at the same point):

* **open**: the first round of every rank after ``initialize``, run before its first pull, push,
  step or any other round. Each rank first publishes shards written since the windows were made
  (``ds_tensor.data = t`` rebinds a shard away from the window: the ``on_open`` hook copies it
  back), so every rank's first forward pulls what every owner wrote before it (ZeRO-3's first
  all-gather orders the same writes);
* **gradient fence** (:meth:`StepProtocol.sync_gradients`): every push so far has landed, counts
  and accumulators are left as they are, and this owner copies its accumulator before any rank pushes
  again (a second round): gradient reads before ``engine.step`` (``get_fp32_grad_partitions``,
  ``safe_get_full_grad``, ``engine.allreduce_gradients()``) then see every rank's micro-batches, as after
  ZeRO-3's reduce-scatter, and keep seeing them while faster peers push their next ones
  ([Note: reads are snapshots], :mod:`ds_odc.runtime.gradient_reads`);
* **discard** (:meth:`StepProtocol.discard_gradients`): ``optimizer.zero_grad()`` called outside a
  step drops the gradients of the micro-batches so far on every rank (ZeRO-3's next backward
  overwrites its partitions): a fence, every owner zeroes its accumulator and the counts, and a
  second round so that no rank pushes before every owner has zeroed;
* windows rewritten (checkpoint load, ``GatheredParameters``) and barriers (checkpoint save);
* **windows away / back**: ``engine.offload_states()`` / ``reload_states()`` move the parameter window and the
  accumulator to host memory and back (:class:`~ds_odc.runtime.residency.Residency`, whose rounds run inside
  :meth:`StepProtocol.meeting`). While one is away the phase is unchanged, and what needs it (a pull, a push,
  the step, a round that reads it) refuses and fails the group, naming the call.

All or nothing: any exception or signal on this rank inside the step, a push, or a round outside
a step records a failure in the group's control plane (:meth:`Transport.mark_failed`) and moves to
FAILED; peers raise :class:`~ds_odc.errors.ODCPeerError` naming the origin, its error and the round
at their next rendezvous, within milliseconds; a dead or stalled peer is found by the rendezvous
itself. In FAILED every pull, push, step and round raises :class:`~ds_odc.errors.ODCGroupFailedError`:
an engine never continues after a failure (its accumulators and windows may hold partial sums).
Pulls are read-only, so a failed pull (and a failed forward) is safe to retry.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ds_odc.comm.cross_node import CrossNodeLink, NodeBlocks
from ds_odc.comm.failure import FailureRecord
from ds_odc.comm.schedule import describe as described_schedule
from ds_odc.comm.schedule import point
from ds_odc.comm.transport import Transport
from ds_odc.errors import ODCGroupFailedError, ODCStateError
from ds_odc.runtime import crash, exact_sum
from ds_odc.runtime.gradient_reads import GradientSnapshot
from ds_odc.runtime.ledger import MicroBatchLedger, StepTotals
from ds_odc.runtime.phases import WHERE, Event, Phase, StepStateMachine
from ds_odc.runtime.residency import Residency
from ds_odc.runtime.round_kinds import WINDOWS_NEEDED, Activity, RoundKind
from ds_odc.runtime.step_update import GlobalNorms, StepUpdate


class StepProtocol:
    """Fence, norm, update, publish, and the group's failure policy. See the module docstring."""

    def __init__(self, transport: Transport, ledger: MicroBatchLedger, on_open: Optional[Callable[[], None]] = None,
                 link: Optional[CrossNodeLink] = None, blocks: Optional[NodeBlocks] = None, exact: bool = False,
                 own_trainable: Optional[tuple[int, int]] = None,
                 on_gradients_moved: Optional[Callable[[], None]] = None):
        self.transport = transport
        self.ledger = ledger
        self.link = link or CrossNodeLink()  # the exchange with the other nodes (nothing on one node)
        self.blocks = blocks or NodeBlocks(1, 0, 0)  # where each node's block sits in the windows
        self.on_open = on_open  # publishes this rank's shards written since the windows were made
        self.opened = False
        self._discarded: Optional[torch.Tensor] = None  # see discard_gradients
        self.machine = StepStateMachine()
        self.step_number = 1  # the step in progress (or the next one); rounds carry it
        self.last_totals: Optional[StepTotals] = None
        self.failure: Optional[FailureRecord] = None
        self._activity: Optional[Activity] = None
        self.residency = Residency(self)  # where this rank's windows are (engine.offload_states moves them)
        self.left: Optional[str] = None  # why this rank left training (leave), if it did
        self.exact = exact  # deterministic accumulation ([Note: exact sums]): two regions, folded at a fence
        # this rank's trainable block in its accumulator, the part a gradient reader may write (None: all of it)
        self.own_trainable = own_trainable
        self.snapshot: Optional[GradientSnapshot] = None  # what gradient reads see ([Note: reads are snapshots])
        # ZeRO-3's gradient views pointed at own_gradients() again (the snapshot, or the accumulator once it ended)
        self.on_gradients_moved = on_gradients_moved
        crash.watch(self)

    @property
    def phase(self) -> Phase:
        return self.machine.phase

    # -- between steps ---------------------------------------------------------------------------------
    def before_pull(self) -> None:
        self._usable()
        self._open()
        self._require({"params"}, "a parameter pull (a forward)")
        self.machine.advance(Event.PULL)
        self._note(Activity.MICRO_BATCHES)

    def before_push(self) -> None:
        self._usable()
        self._open()
        self._require({"grads"}, "a gradient push (a backward)")
        self.machine.advance(Event.PUSH)
        self._discarded = None  # a micro-batch after the discard: the step cannot restore it
        if self.snapshot is not None:  # this rank's own next push: what it read ends here, as on ZeRO-3
            with self.failing_group("a gradient push"):
                self.end_read()
        self._note(Activity.MICRO_BATCHES)

    def record_micro_batch(self, rule, tokens: int = 0, shared: bool = False) -> None:
        self._usable()
        self.ledger.record(rule, tokens, shared)
        self._note(Activity.MICRO_BATCHES, force=True)

    # -- the step ------------------------------------------------------------------------------------------
    def step(self, update: StepUpdate) -> StepTotals:
        """One optimizer step of this rank; returns the fence's global counts."""
        self._usable()
        self._open()
        self._require({"params", "grads"}, "the optimizer step")
        self.machine.advance(Event.BEGIN_STEP)
        with self.failing_group():
            self.end_read()  # a reader's writes are in the accumulator before the fence
            rows = self.link.job_rows(self.round(RoundKind.FENCE, self.ledger.fence_vector()))
            point("fence.exit")
            totals = MicroBatchLedger.totals(rows)
            divisor = totals.gradient_divisor(len(rows), update.gradient_accumulation_steps)
            self.ledger.reset()
            self.last_totals = totals
            self.machine.advance(Event.FENCED)
            accumulator = self.transport.local_grad_accumulator()
            discarded, self._discarded = self._discarded, None
            if discarded is not None and totals.total_micro_batches == 0:
                accumulator.copy_(discarded)  # ZeRO-3 steps on the partitions zero_grad left in place
            gradients = self._sum_landed(accumulator)
            if divisor != 1.0:
                gradients.div_(divisor)
            rows = self.round(RoundKind.NORM, update.squared_norms().to(torch.float64))
            self.machine.advance(Event.NORMED)
            self._note(Activity.UPDATING, force=True)
            update.apply(GlobalNorms(self.link.job_sum(rows.sum(0))))
            # zeroed before the other nodes are told the update is done: with global sharding their ranks push
            # here as soon as they have published
            point("accumulator.zero")
            accumulator.zero_()
            self.link.gather_windows(self.transport.local_param_window(), self.blocks)
            self.machine.advance(Event.UPDATED)
            point("publish")
            self.round(RoundKind.PUBLISH, torch.zeros(0, dtype=torch.float64))
            self.machine.advance(Event.PUBLISHED)
        self.step_number += 1
        self._note(Activity.IDLE, force=True)
        return totals

    def meet(self, kind: RoundKind, what: str = "", values: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A round outside a step (every rank calls it at the same point): windows rewritten by
        their owners (a checkpoint load, GatheredParameters), a barrier (checkpoint save), or values
        every rank contributes (``values``); returns the node's rows."""
        self._usable()
        self._open()
        self._require(WINDOWS_NEEDED.get(kind, set()), what or kind.text)
        self.machine.advance(Event.MEET)
        previous = self._activity or Activity.IDLE
        with self.failing_group(what or kind.text):
            if kind is RoundKind.WINDOWS_REWRITTEN:
                point("window.rewrite")
                self.link.gather_windows(self.transport.local_param_window(), self.blocks, frozen=True)
            rows = self.round(kind, torch.zeros(0, dtype=torch.float64) if values is None else values, what)
            if kind is RoundKind.BARRIER:
                self.link.barrier(what)  # the node's round, then every node's: a barrier of the job
        self._note(previous, force=True)
        return rows

    def norms_outside_step(self, squared: torch.Tensor, what: str) -> GlobalNorms:
        """The norm round outside a step: every owner's squared norms summed over the job (collective)."""
        rows = self.meet(RoundKind.GRADIENT_NORM, what, squared.to(torch.float64))
        with self.failing_group(what):
            return GlobalNorms(self.link.job_sum(rows.sum(0)))

    def sync_gradients(self, what: str) -> bool:
        """A gradient fence without a step (collective): afterwards :attr:`snapshot` holds this owner's
        gradients of every rank's pushes so far, on several nodes summed over them, and keeps holding them
        while peers push on ([Note: reads are snapshots]). Returns whether a new copy was taken (False: no
        rank pushed since the last read, whose copy stays)."""
        self._usable()
        self._open()
        self._require({"grads"}, what)
        self.machine.advance(Event.MEET)
        previous = self._activity or Activity.IDLE
        with self.failing_group(what):
            stale = torch.tensor([float(self.snapshot is None)], dtype=torch.float64)  # pushed, or never read
            # the job's rows: whether to copy must be the same everywhere (summing a copy over nodes is collective);
            # after a node round, a collective with the other nodes is also a barrier of the job, so pushes sent
            # from other nodes before their fence have landed
            rows = self.link.job_rows(self.round(RoundKind.GRADIENT_FENCE, stale, what))
            point("gradient_fence.exit")
            copying = bool(rows.sum() > 0)
            if copying:
                self.end_read()  # a previous copy's writes go into the accumulator before it is copied again
                copy = self.transport.local_grad_accumulator().clone()
                self._sum_landed(copy)
                own = self.own_trainable or (0, copy.numel() // (2 if self.exact else 1))
                self.snapshot = GradientSnapshot(copy, own)
                self.round(RoundKind.GRADIENT_FENCE, torch.zeros(0, dtype=torch.float64), what)  # every owner copied:
                self.link.settle(what)  # only now may a rank push again, on this node or (global sharding) another
        self._note(previous, force=True)
        return copying

    def end_read(self) -> None:
        """This rank's gradient read ends (its own push, its step, a discard, its accumulator moving away):
        what readers wrote into the copy goes into the accumulator, through the push path (atomic against the
        peers' pushes), and ZeRO-3's views are pointed back at the accumulator. Local; no round."""
        snapshot, self.snapshot = self.snapshot, None
        if snapshot is None:
            return
        writes = snapshot.writes()
        if writes is not None:
            offset = snapshot.own[0]
            parts = exact_sum.split(writes) if self.exact else (writes,)
            region = snapshot.copy.numel() // len(parts)
            for index, part in enumerate(parts):
                self.transport.accumulate(self.transport.rank, offset + index * region, part)
        if self.on_gradients_moved is not None:
            self.on_gradients_moved()

    def _sum_landed(self, accumulator: torch.Tensor) -> torch.Tensor:
        """Every push has landed (after a fence): sum the accumulator over nodes, and under exact sums fold the
        fine region into the coarse one ([Note: exact sums]). Returns the gradients ZeRO-3 reads."""
        if not self.exact:
            self.link.reduce_gradients(accumulator, self.blocks)
            return accumulator
        half = accumulator.numel() // 2
        coarse, fine = accumulator.narrow(0, 0, half), accumulator.narrow(0, half, half)
        self.link.reduce_gradients(coarse, self.blocks)
        self.link.reduce_gradients(fine, self.blocks)
        exact_sum.combine(coarse, fine)
        return coarse

    def discard_gradients(self, what: str) -> None:
        """Drop every rank's gradients since the last step (collective): fence, zero this owner's
        accumulator and counts, then meet again so that no rank pushes before every owner zeroed.

        ZeRO-3's ``zero_grad`` only makes the next backward overwrite its partitions: a step with no
        backward anywhere after it updates with the old gradients. So the old accumulator is kept
        until this rank pushes again or the next step, which restores it if no rank ran a micro-batch
        since (the only case where that copy is used; it costs one accumulator while it is kept)."""
        self._usable()
        self._open()
        self._require({"grads"}, what)
        self.machine.advance(Event.DISCARD)
        previous = self._activity or Activity.IDLE
        empty = torch.zeros(0, dtype=torch.float64)
        with self.failing_group(what):
            self.end_read()  # ZeRO-3's discarded partitions held the writes too (a step with no backward uses them)
            self.round(RoundKind.DISCARD, empty, what)
            self.link.settle(what)  # pushes from other nodes (global sharding) have landed too
            accumulator = self.transport.local_grad_accumulator()
            self._discarded = accumulator.clone()
            point("accumulator.zero")
            accumulator.zero_()
            self.ledger.reset()
            self.round(RoundKind.DISCARD, empty, what)
            self.link.settle(what)  # and no rank of another node pushes before every owner has zeroed
        self._note(Activity.IDLE if previous is Activity.MICRO_BATCHES else previous, force=True)

    @contextlib.contextmanager
    def meeting(self, what: str):
        """Around a collective call outside a step that runs its own rounds (:class:`~ds_odc.runtime.residency.
        Residency`'s): the engine must be usable and open, the phase is unchanged, a failure inside poisons the
        group, and this rank's activity is what it was before."""
        self._usable()
        self._open()
        self.machine.advance(Event.MEET)
        previous = self._activity or Activity.IDLE
        with self.failing_group(what):
            yield
        self._note(previous, force=True)

    def _require(self, kinds: set, what: str) -> None:
        """Refuse (failing the group: the ranks have diverged) what needs a window that is away."""
        try:
            self.residency.require(kinds, what)
        except ODCStateError as err:
            self.fail(err, what)
            raise

    def open(self) -> None:
        """Run the open round now (collective; a no-op once it ran): an engine that has no later point where
        every rank is sure to meet (a frozen model, which only pulls) opens while every rank builds it."""
        self._usable()
        self._open()

    def _open(self) -> None:
        """The open round, once, before this rank's first pull, push, step or round."""
        if self.opened:
            return
        self.opened = True
        with self.failing_group(RoundKind.OPEN.text):
            if self.on_open is not None:
                self.on_open()
            point("open")
            self.link.gather_windows(self.transport.local_param_window(), self.blocks, frozen=True)
            self.round(RoundKind.OPEN, torch.zeros(0, dtype=torch.float64))

    @contextlib.contextmanager
    def saving(self):
        """Around a checkpoint save: peers' errors say this rank is saving, and a failure in it
        poisons the group (the others wait in the save's barriers, which are rounds)."""
        self._usable()
        previous = self._activity or Activity.IDLE
        self._note(Activity.SAVING, force=True)
        with self.failing_group("saving a checkpoint"):
            point("save")
            yield
        self._note(previous, force=True)

    def round(self, kind: RoundKind, values: torch.Tensor, what: str = "") -> torch.Tensor:
        """One rendezvous round of the current step (every round of this engine goes through here)."""
        self._note(Activity.IN_ROUND, force=True)
        return self.transport.exchange(kind, self.step_number, values, what or kind.text)

    # -- failure ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def failing_group(self, where: Optional[str] = None):
        """Any exception (or signal-raised exception) inside poisons the group, then propagates."""
        try:
            yield
        except BaseException as err:
            self.fail(err, where or WHERE.get(self.phase, self.phase.value))
            raise

    def fail(self, err: BaseException, where: str) -> None:
        """Record the failure for every peer (the first one wins) and refuse everything after it."""
        if self.phase in (Phase.FAILED, Phase.CLOSED):
            return
        record = getattr(err, "record", None) or \
            FailureRecord(self.transport.job_rank, self.step_number, where, f"{type(err).__name__}: {err}")
        self.failure = record
        self.transport.mark_failed(record)
        self.link.announce(record)
        self.machine.advance(Event.FAIL)
        if hasattr(err, "add_note"):
            err.add_note(f"ds_odc: rank {self.transport.job_rank} marked the ODC group failed (its peers raise at "
                         "their next rendezvous); this engine cannot continue: call engine.destroy()")
            if described_schedule():
                err.add_note(f"ds_odc: under {described_schedule()}: rerun with the same value to reproduce")

    def _usable(self) -> None:
        if self.phase is Phase.FAILED:
            record = self.failure  # set by fail(), the only way into FAILED
            raise ODCGroupFailedError(
                f"the ODC group failed earlier: {record.describe() if record is not None else 'no record'}. This "
                "engine refuses to pull, push or step (results after a failure would be wrong): call engine.destroy(), "
                "restart the job and resume from the last checkpoint", record)
        if self.phase is Phase.CLOSED:
            raise ODCStateError(f"this rank left training ({self.left})" if self.left else
                                "this ODC engine was destroyed (engine.destroy()); build a new one")

    def _note(self, activity: Activity, force: bool = False) -> None:
        if force or activity is not self._activity:
            self._activity = activity
            self.transport.note_activity(activity, self.step_number, self.ledger.micro_batches)

    def leave(self, reason: str) -> None:
        """This rank left training without closing the engine (:func:`ds_odc.runtime.crash.left`): say CLOSED,
        so that peers waiting for it raise at once naming it, while those it already met are unaffected (a
        peer finishing the last round with it must not fail: a failure record would reach it there)."""
        if self.phase in (Phase.FAILED, Phase.CLOSED) or self.transport.plane is None:
            return
        self._note(Activity.LEFT, force=True)
        self.transport.say_closed()
        self.left = reason
        self.machine.advance(Event.CLOSE)
        crash.unwatch(self)

    def close(self) -> None:
        self.snapshot = None
        if self.phase is not Phase.CLOSED:
            if self.transport.plane is not None and self.phase is not Phase.FAILED:
                self._note(Activity.CLOSED, force=True)
            self.machine.advance(Event.CLOSE)
            crash.unwatch(self)
