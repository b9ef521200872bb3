"""Why a group cannot continue: the failure record, and its one encoding.

A record travels two ways: through a node's control blocks (every rank of the node reads it at its
next round) and through the job's key-value store (:class:`~ds_odc.comm.cross_node.FailureBoard`,
read by the ranks of the other nodes). Both carry the bytes of :meth:`FailureRecord.encode`.

>>> record = FailureRecord(3, 7, "the step fence", "RuntimeError: injected")
>>> FailureRecord.decode(record.encode()) == record, record.describe()
(True, 'rank 3 failed at the step fence (step 7): RuntimeError: injected')
"""
from __future__ import annotations

import enum
import struct
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ds_odc.errors import ODCPeerError

#: Longest encoding, header included (a control block reserves this much; longer messages are cut).
RECORD_BYTES = 1024
_HEADER = struct.Struct("<qqq")  # origin, step, kind
#: How long a rank whose message or collective to another node broke waits for the job's failure board to say why
#: (a node names a dead rank within milliseconds; its ranks may be busy for a while before their next round
#: notices it). Bounded by the job's ``timeout_s`` where that is shorter.
CAUSE_GRACE_S = 10.0
#: How often that wait reads the board.
CAUSE_POLL_S = 0.01


class FailureKind(enum.IntEnum):
    """How the origin failed: it raised, or a peer saw it stall, exit or close."""

    RAISED = 0
    STALLED = 1
    EXITED = 2
    CLOSED = 3


@dataclass(frozen=True)
class FailureRecord:
    """Who failed first, where, and the error.

    RAISED: ``where`` is the phase ("the step fence", "a gradient push"), ``error`` "Type: message".
    STALLED / EXITED / CLOSED: ``where`` is what the rank was last doing, ``error`` what was seen of it
    ("made no progress for 600s", "exited ..."), as a peer recorded it."""

    origin: int
    step: int
    where: str
    error: str
    kind: FailureKind = FailureKind.RAISED

    def describe(self) -> str:
        if self.kind is FailureKind.RAISED:
            return f"rank {self.origin} failed at {self.where} (step {self.step}): {self.error}"
        return f"rank {self.origin} {self.error} while {self.where}"

    def encode(self) -> bytes:
        """At most :data:`RECORD_BYTES` bytes: the header, then ``where`` and ``error`` (cut to fit)."""
        text = f"{self.where}\n{self.error}".encode("utf-8", "replace")
        return _HEADER.pack(self.origin, self.step, int(self.kind)) + text[:RECORD_BYTES - _HEADER.size]

    @classmethod
    def decode(cls, raw: bytes) -> "FailureRecord":
        origin, step, kind = _HEADER.unpack_from(raw)
        where, _, error = raw[_HEADER.size:].decode("utf-8", "replace").partition("\n")
        return cls(origin, step, where, error, FailureKind(kind))


def wait_for_cause(read: Callable[[], Optional[FailureRecord]], grace_s: float,
                   between_reads: Callable[[], None] = lambda: None) -> Optional[FailureRecord]:
    """The failure board's record, read with ``read`` until one is posted or ``grace_s`` has passed. A link to
    another node breaks as soon as a peer's connection closes, a little before that peer's node has named what
    happened to it, so the better explanation is worth a short wait. None when nothing was posted in time, or the
    board itself cannot be reached (``read`` raised :class:`~ds_odc.errors.ODCPeerError`): the caller then names
    what it saw. ``between_reads`` runs after each empty read (a rank that waits keeps its heartbeat)."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            record = read()
        except ODCPeerError:
            return None
        if record is not None or time.monotonic() > deadline:
            return record
        between_reads()
        time.sleep(CAUSE_POLL_S)
