"""Typed rendezvous rounds over the control blocks: checked, bounded, and never misread.

A round is identified by ``(seq, step, kind, length)``: the rank's round counter, the optimizer
step it belongs to, what the round is for (a number the protocol above assigns and names, see
:mod:`ds_odc.comm.wording`) and how many values it carries.
Round ``seq`` writes its payload into the slot of parity ``seq % 2`` and publishes the header with
a release store of ``seq``; it completes once every peer's slot of that parity holds ``seq``. Two
slots suffice: a rank can start round ``seq + 2`` only after every rank has *arrived* at
``seq + 1``, i.e. after everyone finished reading round ``seq``.

Every peer's header is compared with this rank's: a peer at the same ``seq`` with another step,
kind or length is an error on both sides, naming both (ranks called different things: one
``engine.step()`` more on one rank, a checkpoint saved by one rank only), instead of reading counts
as norms. While waiting, the rank also watches every pending peer for

* a **failure record** (the peer, or a rank it heard from, failed): raised at once, naming the
  origin, its error and where it happened;
* **death** (its life lock is free): raised within :data:`LIVENESS_PERIOD_S`;
* **closing** (``engine.destroy()``) while others still wait for it;
* **no progress** for ``timeout_s`` (no heartbeat, activity or round change): a peer that is
  merely slow keeps beating and is waited for.

A failed round is final: the rendezvous refuses further rounds (a retried round would pair with
whatever round the peers are in).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ds_odc.comm.backoff import Backoff
from ds_odc.comm.control import ControlPlane, State
from ds_odc.comm.failure import FailureKind, FailureRecord
from ds_odc.errors import ODCPeerError, ODCTimeoutError

#: How often a waiting rank checks that the peers it waits for are alive.
LIVENESS_PERIOD_S = 0.05
TIMEOUT_HINT = ("A rank busy with long host-side work between backward and engine.step() (evaluation, logging, "
                "saving) needs a longer bound: set zero_optimization.odc.timeout_s (seconds), or the process-group "
                "timeout it follows by default (deepspeed.init_distributed(timeout=...), or DEEPSPEED_TIMEOUT in "
                "minutes).")


class Rendezvous:
    """All-to-all exchange of small float vectors through the control blocks of ``plane``."""

    def __init__(self, plane: ControlPlane, width: int, timeout_s: float):
        self.plane = plane
        self.width = width
        self.timeout_s = timeout_s
        self.seq = 0  # rounds this rank completed
        self.broken: Optional[ODCPeerError] = None

    def exchange(self, kind: int, step: int, values: torch.Tensor, what: str = "") -> torch.Tensor:
        """Contribute ``values`` (1-D, at most ``width``) to round ``kind`` of ``step``; return the
        ``[world, n]`` float64 rows, row r from rank r. Raises :class:`~ds_odc.errors.ODCPeerError`
        (:class:`~ds_odc.errors.ODCTimeoutError` for a stalled peer) carrying the failure's record."""
        if self.broken is not None:
            raise ODCPeerError(f"this rank's rendezvous already failed ({self.broken}); the group cannot continue",
                               self.broken.record)
        values = values.detach().reshape(-1)
        n = values.numel()
        if n > self.width:
            raise ValueError(f"rendezvous payload of {n} values exceeds the width {self.width}")
        seq = self.seq + 1
        me = self.plane.me
        me.write_round(seq, step, int(kind), values)
        try:
            self._wait(seq, step, int(kind), n, what or self.plane.wording.round_name(int(kind)))
        except ODCPeerError as err:
            self.broken = err
            raise
        self.seq = seq
        parity = seq % 2
        return torch.stack([block.round_payload(parity, n) for block in self.plane.blocks])

    # -- waiting ---------------------------------------------------------------------------------------
    def _wait(self, seq: int, step: int, kind: int, n: int, what: str) -> None:
        plane, parity = self.plane, seq % 2
        here = f"rank {plane.job_rank(plane.rank)} was at round {seq} ({what}, step {step})"
        pending = plane.peers()
        marks = {r: plane.blocks[r].progress_mark() for r in pending}
        last_progress = dict.fromkeys(pending, time.monotonic())
        next_check = time.monotonic() + LIVENESS_PERIOD_S
        backoff = Backoff()
        while True:
            still = []
            for r in pending:
                block = plane.blocks[r]
                if block.round_seq(parity) == seq:
                    self._check_header(r, block.round_header(parity), (step, kind, n), seq, here)
                else:
                    still.append(r)
            pending = still
            self._raise_on_failures(range(plane.world_size) if not pending else pending, here)
            if not pending:
                return
            now = time.monotonic()
            if now >= next_check:
                next_check = now + LIVENESS_PERIOD_S
                self._check_pending(pending, marks, last_progress, now, here, step)
            backoff.sleep()

    def _check_header(self, peer: int, theirs: tuple, mine: tuple, seq: int, here: str) -> None:
        if theirs == mine:
            return
        step, kind, n = theirs
        kind_text = self.plane.wording.round_name(kind)
        message = (f"{self.plane.describe(peer)} is at round {seq} ({kind_text}, step {step}, {n} values) "
                   f"where {here.replace('was at', 'is at')} with {mine[2]} values: the ranks called different things "
                   "(e.g. engine.step() or save_checkpoint() on some ranks only, or a different number of times)")
        self._fail(message, FailureRecord(self.plane.job_rank(peer), step, kind_text,
                                          "rounds out of step: " + message))

    def _raise_on_failures(self, ranks, here: str) -> None:
        for r in ranks:
            if r == self.plane.rank:
                continue
            state = self.plane.blocks[r].state()
            if state == State.FAILED:
                record = self.plane.blocks[r].read_failure()
                self._fail(f"{record.describe()}; {here} (reported by {self.plane.describe(r)})", record)

    def _check_pending(self, pending, marks, last_progress, now: float, here: str, step: int) -> None:
        plane = self.plane
        for r in pending:
            block = plane.blocks[r]
            if block.state() == State.CLOSED:
                record = FailureRecord(plane.job_rank(r), step, "its peers waited for it",
                                       "closed its engine (engine.destroy())", FailureKind.CLOSED)
                self._fail(f"{plane.describe(r)} closed its engine (engine.destroy()) while {here}", record)
            if not plane.alive(r):
                record = FailureRecord(plane.job_rank(r), step, plane.activity_text(r),
                                       "exited (killed, crashed, or its script ended)", FailureKind.EXITED)
                self._fail(f"{plane.describe(r)} {record.error} while {record.where}; {here}", record)
            mark = block.progress_mark()
            if mark != marks[r]:
                marks[r], last_progress[r] = mark, now
        stalled = [r for r in pending if now - last_progress[r] > self.timeout_s]
        if stalled:
            r = stalled[0]
            record = FailureRecord(plane.job_rank(r), step, plane.activity_text(r),
                                   f"made no progress for {self.timeout_s:.0f}s", FailureKind.STALLED)
            message = f"{plane.describe(r)} {record.error}; it was last {record.where}; {here}. {TIMEOUT_HINT}"
            self._fail(message, record, timeout=True)

    def _fail(self, message: str, record: FailureRecord, timeout: bool = False) -> None:
        raise (ODCTimeoutError if timeout else ODCPeerError)(message, record)
