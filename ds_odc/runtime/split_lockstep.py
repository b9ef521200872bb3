"""The members of a split micro-batch run it together: checked before each of its forwards.

Under the split policy (``"lb-mini-split"``, :mod:`ds_odc.balance.split`) a long sample runs over an aligned group
of ranks with Ulysses attention (all-to-alls inside every attention layer), while every rank runs its own number
of whole micro-batches. The members of a group share only their split micro-batches, which every rank runs
first, in the plan's one order (``MicroBatch.sequence``). So the fixed-SP lockstep's count of forwards
(:mod:`ds_odc.runtime.lockstep`) cannot work here: a member compares the plan's sequence number instead.

Before every forward a rank publishes a key (a word of its control block, release store): inside a split
micro-batch ``(step, sequence, forwards begun in it)``, and ``(step, OWN)`` inside one of its own (whole) entries,
which every sequence of the step precedes. A forward outside every entry (an evaluation, a reference model's
log-probs computed before the step's micro-batches, as TRL's DPO precompute and GRPO's old log-probs do)
publishes nothing: it belongs to no place in the plan's order, so it can neither pass a split micro-batch nor
be passed by one, and a member late by any amount is simply waited for. A member of split micro-batch ``k``
then waits until every other member has published ``k`` with as many forwards begun. [Note: split lockstep]
What the peer's key says, when it is not there yet:

* a later split micro-batch, or its own micro-batches, in the same step: it is past ``k`` without running
  this forward with this rank (each forward of a split micro-batch meets its members in the all-to-alls of its
  attention layers, which this rank has not entered yet): it skipped ``k``, or this rank runs one its plan does
  not give it: a **mismatch**;
* a round this rank has not entered (the step fence, a barrier): it ran fewer: a **mismatch**;
* anything earlier: it has not got there yet, and is waited for as in any round
  (:class:`~ds_odc.comm.peer_watch.PeerWatch`: named at once when it fails, dies or closes, and after
  ``timeout_s`` without progress).

A mismatch is raised at once and recorded for the group, naming the split micro-batch, its ranks and what each
of the two was doing, so every rank of the job raises it (the other members at their wait, the rest at their
next round). The wait costs nothing in a correct run: the members are about to meet in the forward's first
all-to-all anyway. A member that dies *inside* an all-to-all leaves the others with the collective's own error;
:meth:`SplitLockstep.collectives` turns it into one naming that member. Forwards of a frozen model (a reference
model) inside a split micro-batch count as forwards of it too: the members run the same forwards in it.

Keys increase through a job (the step in the high bits), so a key left from an earlier step never reads as a
later one:

>>> split_key(3, 5, 2) > split_key(3, 5, 1) > split_key(3, 4, 9) and split_key(4, 0, 1) > split_key(3, OWN, 0)
True
>>> parse_split_key(split_key(3, 5, 2))
(3, 5, 2)
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional, Sequence

from ds_odc.comm.backoff import Backoff
from ds_odc.comm.peer_watch import PeerWatch
from ds_odc.errors import ODCError
from ds_odc.runtime.lockstep import naming_dead_peers, ranks_text
from ds_odc.runtime.step import StepProtocol

FORWARD_BITS, SEQUENCE_BITS = 12, 20
#: The sequence a rank publishes before a forward of its own (whole) micro-batches: after every split one.
OWN = (1 << SEQUENCE_BITS) - 1
MAX_FORWARDS = (1 << FORWARD_BITS) - 1


def split_key(step: int, sequence: int, forwards: int) -> int:
    """The word a rank publishes: step, then the split micro-batch's sequence, then forwards begun in it."""
    return (step << (SEQUENCE_BITS + FORWARD_BITS)) | (sequence << FORWARD_BITS) | forwards


def parse_split_key(key: int) -> tuple[int, int, int]:
    """``(step, sequence, forwards)`` of a key."""
    return key >> (SEQUENCE_BITS + FORWARD_BITS), (key >> FORWARD_BITS) & OWN, key & MAX_FORWARDS


class ODCSplitError(ODCError):
    """The members of a split micro-batch did not run the same split micro-batches."""


@dataclasses.dataclass(frozen=True)
class SplitEntry:
    """The split micro-batch this rank is in: its place in the plan's order and its members (job ranks)."""

    sequence: int
    members: tuple[int, ...]

    @property
    def title(self) -> str:
        return f"split micro-batch {self.sequence} (ranks {ranks_text(self.members)})"


class SplitLockstep:
    """One rank's lockstep over the split micro-batches it is a member of (see the module docstring)."""

    def __init__(self, protocol: StepProtocol, timeout_s: float):
        self.protocol, self.timeout_s = protocol, timeout_s
        self.me = protocol.transport.job_rank
        self.entry: Optional[SplitEntry] = None
        self.forwards = 0
        self.own = False  # inside one of this rank's own (whole) entries: its forwards publish OWN

    # -- entering and leaving a split micro-batch ----------------------------------------------------------
    def enter(self, sequence: int, members: Sequence[int]) -> None:
        """This rank starts split micro-batch ``sequence`` of the step with ``members`` (all on this node)."""
        members = tuple(int(m) for m in members)
        if self.entry is not None or self.own:
            inside = self.entry.title if self.entry is not None else "one of its own micro-batches"
            raise ODCSplitError(f"rank {self.me} entered split micro-batch {sequence} inside {inside}: "
                                "run one micro-batch at a time")
        if not 0 <= sequence < OWN:
            raise ODCSplitError(f"split micro-batch sequence {sequence} is outside [0, {OWN})")
        if self.me not in members or len(members) < 2:
            raise ODCSplitError(f"rank {self.me} is not a member of split micro-batch {sequence} (ranks "
                                f"{ranks_text(members)}): run only the entries of this rank's own list")
        plane = self.protocol.transport.control_plane
        outside = [m for m in members if not plane.first_rank <= m < plane.first_rank + plane.world_size]
        if outside:
            raise ODCSplitError(f"split micro-batch {sequence} (ranks {ranks_text(members)}) spans nodes (ranks "
                                f"{ranks_text(outside)} are not on this rank's node): split groups lie inside a node")
        self.entry, self.forwards = SplitEntry(sequence, members), 0

    def leave(self) -> None:
        self.entry = None

    @contextlib.contextmanager
    def inside(self, sequence: int, members: Sequence[int]):
        """:meth:`enter` ... :meth:`leave` around the micro-batch's forwards and backward."""
        self.enter(sequence, members)
        try:
            yield self.entry
        finally:
            self.leave()

    @contextlib.contextmanager
    def own_entry(self):
        """Around one of this rank's own (whole) entries: its forwards publish OWN (every split micro-batch of
        the step is behind this rank)."""
        if self.entry is not None:
            raise ODCSplitError(f"rank {self.me} began a whole micro-batch inside {self.entry.title}: run one "
                                "micro-batch at a time")
        self.own = True
        try:
            yield
        finally:
            self.own = False

    # -- before a forward ------------------------------------------------------------------------------------
    def before_forward(self) -> None:
        """Publish this forward's key; inside a split micro-batch, wait until every other member has begun it.
        A forward outside every entry publishes nothing (the module docstring says why)."""
        protocol = self.protocol
        plane = protocol.transport.control_plane
        step = protocol.step_number
        entry = self.entry
        if entry is None:
            if self.own:
                plane.me.set_split_key(split_key(step, OWN, 0))
            return
        if self.forwards >= MAX_FORWARDS:
            raise ODCSplitError(f"{entry.title}: more than {MAX_FORWARDS} forwards in one micro-batch")
        self.forwards += 1
        plane.me.set_split_key(split_key(step, entry.sequence, self.forwards))
        first = plane.first_rank
        peers = [m - first for m in entry.members if m != self.me]
        rendezvous = protocol.transport.active_rendezvous
        here = (f"rank {self.me} was starting forward {self.forwards} of {entry.title} in step {step}")
        with protocol.failing_group("the split micro-batch lockstep (before a forward)"):
            watch = PeerWatch(plane, peers, self.timeout_s, step, here)
            pending, backoff = peers, Backoff()
            while True:
                waiting = []
                for r in pending:
                    their_step, sequence, forwards = parse_split_key(plane.blocks[r].split_key())
                    if (their_step, sequence) == (step, entry.sequence) and forwards >= self.forwards:
                        continue
                    if their_step == step and sequence > entry.sequence:
                        self._passed(r, sequence, step)
                    if plane.blocks[r].latest_seq() > rendezvous.seq:
                        self._went_to_round(r, step)
                    waiting.append(r)
                if not waiting:
                    return
                pending = waiting
                watch.raise_on_failures(pending)
                watch.poll(pending)
                backoff.sleep()

    def _passed(self, peer: int, sequence: int, step: int) -> None:
        plane = self.protocol.transport.control_plane
        entry = self.entry
        assert entry is not None
        where = "its own micro-batches" if sequence == OWN else f"split micro-batch {sequence}"
        raise ODCSplitError(
            f"{entry.title}: rank {self.me} started it in step {step} while rank {plane.job_rank(peer)} had gone on to "
            f"{where}: every member runs the split micro-batches it belongs to, in the plan's order, before its own "
            "(one member skipped it, or the other runs one its plan does not give it)")

    def _went_to_round(self, peer: int, step: int) -> None:
        plane = self.protocol.transport.control_plane
        entry = self.entry
        assert entry is not None
        block = plane.blocks[peer]
        _, _, done = block.activity()
        _, kind, _ = block.round_header(block.latest_seq() % 2)
        raise ODCSplitError(
            f"{entry.title}: rank {self.me} started it in step {step} while rank {plane.job_rank(peer)} went to "
            f"{plane.wording.round_name(kind)} after {done} micro-batches: every member runs the split micro-batches "
            "it belongs to (one member skipped it, or the other runs one its plan does not give it)")

    # -- around forward and backward ---------------------------------------------------------------------------
    def collectives(self, where: str):
        """Around a forward or backward: an error raised inside (an all-to-all's, when a member died in it)
        becomes one naming the member that exited or failed, if one did."""
        return naming_dead_peers(self.protocol, self._group, where)

    def _group(self) -> tuple[list[int], str]:
        entry = self.entry
        if entry is None:
            return [], ""
        first = self.protocol.transport.control_plane.first_rank
        return [m - first for m in entry.members if m != self.me], entry.title
