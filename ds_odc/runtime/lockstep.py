"""The ranks of one sequence-parallel group run the same micro-batches: checked before each forward.

Under Ulysses sequence parallelism (DeepSpeed ALST) the ranks of an SP group each hold a slice of the
same sequences and meet inside every attention layer (all-to-alls). Different SP groups may run
different numbers of micro-batches per step, as different data-parallel ranks may on the odc stage; the
ranks *inside* one group may not. Left alone, a rank starting one micro-batch more than its SP partner
waits inside the all-to-all while the partner waits at the step fence, until the no-progress bound, and
the message then blames the wrong rank.

So before every forward a rank publishes how many forwards it has begun (a word of its control block)
and waits until each SP peer has begun as many. A peer that instead entered a round this rank has not
(the step fence, a barrier) ran fewer micro-batches: that is a mismatch, raised at once and recorded for
the group, naming the SP group, both ranks and both counts, so every rank of the job raises it (the
partner at its round, the others at theirs). A peer that dies, fails, closes or stalls while this rank
waits is named as in any round (:class:`~ds_odc.comm.peer_watch.PeerWatch`). The wait costs nothing in
a correct run: the partners are about to meet in the forward's first all-to-all anyway.

A peer that dies *inside* an SP collective leaves this rank with the collective's own error (gloo:
"connection closed"); :meth:`SequenceParallelLockstep.collectives` turns it into one that names the peer.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional, Sequence

from ds_odc.comm.backoff import Backoff
from ds_odc.comm.control import State
from ds_odc.comm.failure import FailureKind, FailureRecord
from ds_odc.comm.peer_watch import PeerWatch
from ds_odc.errors import ODCError, ODCPeerError
from ds_odc.runtime.step import StepProtocol

#: How long a collective's error waits for the control blocks to show which SP peer died.
DEATH_GRACE_S = 2.0


class ODCSequenceParallelError(ODCError):
    """The ranks of one sequence-parallel group did not run the same micro-batches."""


class SequenceParallelLockstep:
    """One rank's view of its SP group (``members``: job ranks, all on this rank's node)."""

    def __init__(self, protocol: StepProtocol, group: int, members: Sequence[int], timeout_s: float):
        transport = protocol.transport
        plane = transport.control_plane
        first = plane.first_rank
        outside = [m for m in members if not first <= m < first + plane.world_size]
        if outside:
            raise ODCError(f"sequence-parallel group {group} (ranks {ranks_text(members)}) spans nodes (ranks "
                           f"{ranks_text(outside)} are not on this rank's node): the odc stage needs every SP group "
                           "within one node")
        self.protocol, self.group, self.members, self.timeout_s = protocol, group, list(members), timeout_s
        self.me = transport.job_rank
        self.peers = [m - first for m in members if m != self.me]  # their control blocks on this node
        self.forwards = 0

    @property
    def title(self) -> str:
        return f"sequence-parallel group {self.group} (ranks {ranks_text(self.members)})"

    def before_forward(self) -> None:
        """Publish one more forward and wait for every SP peer to begin it too (see the module docstring)."""
        protocol = self.protocol
        transport = protocol.transport
        self.forwards += 1
        plane, rendezvous = transport.control_plane, transport.active_rendezvous
        plane.me.set_forwards(self.forwards)
        step = protocol.step_number
        starting = protocol.ledger.micro_batches + 1
        here = f"rank {self.me} was starting micro-batch {starting} of step {step} in {self.title}"
        with protocol.failing_group("the sequence-parallel lockstep (before a forward)"):
            watch = PeerWatch(plane, self.peers, self.timeout_s, step, here)
            pending, backoff = list(self.peers), Backoff()
            while True:
                pending = [r for r in pending if plane.blocks[r].forwards() < self.forwards]
                if not pending:
                    return
                for r in pending:
                    if plane.blocks[r].latest_seq() > rendezvous.seq:
                        self._mismatch(r, starting, step)
                watch.raise_on_failures(pending)
                watch.poll(pending)
                backoff.sleep()

    def _mismatch(self, peer: int, starting: int, step: int) -> None:
        plane = self.protocol.transport.control_plane
        block = plane.blocks[peer]
        _, _, done = block.activity()
        seq = block.latest_seq()
        _, kind, _ = block.round_header(seq % 2)
        raise ODCSequenceParallelError(
            f"{self.title}: rank {self.me} started micro-batch {starting} of step {step} while rank "
            f"{plane.job_rank(peer)} went to {plane.wording.round_name(kind)} after {done} micro-batches: the ranks "
            "of one SP group must run the same micro-batches (Ulysses' all-to-alls pair their forwards); different "
            "SP groups may run different counts")

    @contextlib.contextmanager
    def collectives(self, where: str):
        """Around a forward or backward: an error raised inside (an SP collective's, when a peer died in it)
        becomes one naming the SP peer that exited or failed, if one did."""
        with naming_dead_peers(self.protocol, lambda: (self.peers, self.title), where):
            yield


@contextlib.contextmanager
def naming_dead_peers(protocol: StepProtocol, group: Callable[[], tuple[list[int], str]], where: str):
    """An error raised inside (a collective's, when a peer of the group died in it) becomes one naming the peer
    that exited or failed, if one did; ``group()``: the peers' control blocks and the group's title, or no
    peers when this rank is in no group now."""
    try:
        yield
    except ODCError:
        raise
    except Exception as err:
        peers, title = group()
        named = _peer_failure(protocol, peers, title, where) if peers else None
        if named is None:
            raise
        protocol.fail(named, where)
        raise named from err


def _peer_failure(protocol: StepProtocol, peers: Sequence[int], title: str, where: str) -> Optional[ODCPeerError]:
    """The first of ``peers`` (control blocks of this node) that failed or exited, within :data:`DEATH_GRACE_S`."""
    plane = protocol.transport.plane
    if plane is None:
        return None
    me = protocol.transport.job_rank
    deadline = time.monotonic() + DEATH_GRACE_S
    while True:
        for r in peers:
            record = plane.failure_of(r)
            if record is None and not plane.alive(r):
                record = FailureRecord(plane.job_rank(r), protocol.step_number, plane.activity_text(r),
                                       "exited (killed, crashed, or its script ended)", FailureKind.EXITED)
            if record is not None:
                return ODCPeerError(f"{record.describe()}; rank {me} was in {where} with it ({title}), "
                                    "inside a sequence-parallel collective", record)
        if time.monotonic() >= deadline or any(plane.blocks[r].state() == State.CLOSED for r in peers):
            return None
        time.sleep(0.05)


def ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
