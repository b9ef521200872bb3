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
from dataclasses import dataclass

#: Longest encoding, header included (a control block reserves this much; longer messages are cut).
RECORD_BYTES = 1024
_HEADER = struct.Struct("<qqq")  # origin, step, kind


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
