"""Waiting on peers through the control blocks, bounded and never blind.

Every wait of one rank on others of its node (a rendezvous round, the sequence-parallel lockstep) watches
the peers it waits for the same way:

* a **failure record** (the peer, or a rank it heard from, failed): raised at once, naming the origin, its
  error and where it happened;
* **death** (its life lock is free): raised within :data:`LIVENESS_PERIOD_S`;
* **closing** (``engine.destroy()``, or leaving training: :func:`ds_odc.runtime.crash.left`) while this rank
  still waits for it;
* **no progress** for ``timeout_s`` (no heartbeat, activity or round change): a peer that is merely slow
  keeps beating and is waited for.
"""
from __future__ import annotations

import time
from typing import Iterable, List

from ds_odc.comm.control import ControlPlane, State
from ds_odc.comm.failure import FailureKind, FailureRecord
from ds_odc.errors import ODCPeerError, ODCTimeoutError

#: How often a waiting rank checks that the peers it waits for are alive.
LIVENESS_PERIOD_S = 0.05
TIMEOUT_HINT = ("A rank busy with long host-side work between backward and engine.step() (evaluation, logging, "
                "saving) needs a longer bound: set zero_optimization.odc.timeout_s (seconds), or the process-group "
                "timeout it follows by default (deepspeed.init_distributed(timeout=...), or DEEPSPEED_TIMEOUT in "
                "minutes).")


class PeerWatch:
    """One wait of this rank on ``peers``; ``here`` says what this rank was doing, for every message."""

    def __init__(self, plane: ControlPlane, peers: Iterable[int], timeout_s: float, step: int, here: str):
        self.plane, self.timeout_s, self.step, self.here = plane, timeout_s, step, here
        now = time.monotonic()
        self.marks = {r: plane.blocks[r].progress_mark() for r in peers}
        self.last_progress = dict.fromkeys(self.marks, now)
        self.next_check = now + LIVENESS_PERIOD_S

    def raise_on_failures(self, ranks: Iterable[int]) -> None:
        """A failure record in any of ``ranks``' blocks is raised here, naming its origin."""
        for r in ranks:
            if r == self.plane.rank:
                continue
            if self.plane.blocks[r].state() == State.FAILED:
                record = self.plane.blocks[r].read_failure()
                self.fail(f"{record.describe()}; {self.here} (reported by {self.plane.describe(r)})", record)

    def poll(self, pending: List[int]) -> None:
        """Every :data:`LIVENESS_PERIOD_S`: a pending peer that closed, exited or stalled is raised."""
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + LIVENESS_PERIOD_S
        plane = self.plane
        for r in pending:
            block = plane.blocks[r]
            if block.state() == State.CLOSED:  # its activity says how: engine.destroy(), or it left training
                record = FailureRecord(plane.job_rank(r), self.step, "its peers waited for it",
                                       plane.activity_text(r), FailureKind.CLOSED)
                self.fail(f"{plane.describe(r)} {record.error} while {self.here}", record)
            if not plane.alive(r):
                record = FailureRecord(plane.job_rank(r), self.step, plane.activity_text(r),
                                       "exited (killed, crashed, or its script ended)", FailureKind.EXITED)
                self.fail(f"{plane.describe(r)} {record.error} while {record.where}; {self.here}", record)
            mark = block.progress_mark()
            if mark != self.marks[r]:
                self.marks[r], self.last_progress[r] = mark, now
        stalled = [r for r in pending if now - self.last_progress[r] > self.timeout_s]
        if stalled:
            r = stalled[0]
            record = FailureRecord(plane.job_rank(r), self.step, plane.activity_text(r),
                                   f"made no progress for {self.timeout_s:.0f}s", FailureKind.STALLED)
            message = f"{plane.describe(r)} {record.error}; it was last {record.where}; {self.here}. {TIMEOUT_HINT}"
            self.fail(message, record, timeout=True)

    @staticmethod
    def fail(message: str, record: FailureRecord, timeout: bool = False) -> None:
        raise (ODCTimeoutError if timeout else ODCPeerError)(message, record)
