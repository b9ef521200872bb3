"""Control blocks: the small shared words through which ranks of one node see each other.

Every rank owns one block (a few KiB of shared memory) that it alone writes and every peer reads::

    header   magic, state, heartbeat, activity (what, step, count), pid, unmapped-flag, forwards, split key
    failure  length, record bytes                             (the group's poison record, comm/failure.py)
    slot 0   seq, step, kind, length, payload[width]           (rendezvous rounds of even seq)
    slot 1   seq, step, kind, length, payload[width]           (odd seq)
    blob     length, bytes                                    (e.g. CUDA IPC handles)

Ordering: a writer fills payload, failure record or blob with plain stores, then publishes it with
a *release* store of a control word (a slot's ``seq``, ``state``); a reader *acquire*-loads that
word before reading what it guards (:mod:`ds_odc.comm.ordering`). Heartbeat and activity are
informational (progress and error messages) and use plain accesses.

:class:`ControlPlane` is one rank's view of the group: its own block, its peers' blocks, and a
liveness test per peer (the life lock of :mod:`ds_odc.comm.locks` for real transports). Activities
and round kinds are numbers here; the protocol above supplies their words (:mod:`ds_odc.comm.wording`).
"""
from __future__ import annotations

import enum
from typing import Callable, List, Optional

import torch

from ds_odc.comm.failure import RECORD_BYTES, FailureRecord
from ds_odc.comm.wording import NUMBERS, Wording

MAGIC = 0x0DC0_0004  # layout version, written into every block by init() (a marker for a reader of raw blocks)
# header words
W_MAGIC, W_STATE, W_HEARTBEAT, W_ACTIVITY, W_ACTIVITY_STEP, W_ACTIVITY_COUNT, W_PID, W_UNMAPPED, W_FORWARDS = range(9)
W_SPLIT = 9
HEADER_WORDS = 16
FAILURE_AT = HEADER_WORDS  # nbytes, then the record's bytes
SLOTS_AT = FAILURE_AT + 1 + RECORD_BYTES // 8
SLOT_HEADER = 4  # seq, step, kind, length
BLOB_BYTES = 256


class State(enum.IntEnum):
    """A rank's lifecycle, published with release stores."""

    FAILED = -1  # the rank failed (or learned of a failure): the failure record says which and why
    CREATED = 1  # the block exists; the rank is creating its windows
    READY = 2  # its windows exist (and are reserved)
    RUNNING = 3  # every rank mapped every window: training
    CLOSED = 4  # the rank released its transport (engine.destroy())


def block_words(width: int) -> int:
    """Size in 64-bit words of a control block whose rounds carry up to ``width`` values."""
    return SLOTS_AT + 2 * (SLOT_HEADER + width) + 1 + BLOB_BYTES // 8


class ControlBlock:
    """One rank's block (a mapped int64 tensor); ``ordering`` provides release/acquire accesses."""

    def __init__(self, words: torch.Tensor, width: int, ordering):
        if words.dtype != torch.int64 or words.numel() < block_words(width):
            raise ValueError(f"a control block needs {block_words(width)} int64 words")
        self.words = words
        self.floats = words.view(torch.float64)
        self.bytes = words.view(torch.uint8)
        self._plain = words.numpy()  # plain accesses on the hot path (a heartbeat per module) cost ~0.1 us
        self.width = width
        self.ordering = ordering

    # -- state and failure ---------------------------------------------------------------------------
    def init(self, pid: int) -> None:
        self.words.zero_()
        self.words[W_MAGIC] = MAGIC
        self.words[W_PID] = pid
        self.ordering.store_release(self.words, W_STATE, State.CREATED)

    def state(self) -> int:
        return self.ordering.load_acquire(self.words, W_STATE)

    def set_state(self, state: State) -> None:
        self.ordering.store_release(self.words, W_STATE, int(state))

    def write_failure(self, record: FailureRecord) -> None:
        """Record ``record`` and publish State.FAILED (the record is visible before the state)."""
        raw = record.encode()
        self.words[FAILURE_AT] = len(raw)
        start = (FAILURE_AT + 1) * 8
        self.bytes[start:start + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.set_state(State.FAILED)

    def read_failure(self) -> FailureRecord:
        """The record of a block whose state was acquire-loaded as FAILED."""
        nbytes = int(self.words[FAILURE_AT])
        start = (FAILURE_AT + 1) * 8
        return FailureRecord.decode(bytes(self.bytes[start:start + nbytes].tolist()))

    # -- progress and activity (plain accesses) --------------------------------------------------------
    def heartbeat(self) -> None:
        self._plain[W_HEARTBEAT] += 1

    def set_activity(self, activity: int, step: int, count: int = 0) -> None:
        plain = self._plain
        plain[W_ACTIVITY_STEP] = step
        plain[W_ACTIVITY_COUNT] = count
        plain[W_ACTIVITY] = int(activity)

    def progress_mark(self) -> tuple:
        """Changes whenever the rank makes progress (beats, changes activity, enters a round)."""
        return tuple(self._plain[W_HEARTBEAT:W_ACTIVITY_COUNT + 1].tolist()) + (self.latest_seq(),)

    def activity(self) -> tuple:
        """``(activity, step, count)`` as the rank last set them (plain reads: informational)."""
        return tuple(int(v) for v in self._plain[W_ACTIVITY:W_ACTIVITY_COUNT + 1].tolist())

    def pid(self) -> int:
        return int(self.words[W_PID])

    # -- sequence-parallel lockstep (ds_odc.runtime.lockstep) ----------------------------------------
    def set_forwards(self, count: int) -> None:
        """The number of forwards this rank has begun, published with a release store: its SP peers
        start theirs only once they see it (they are paired by the collectives inside)."""
        self.ordering.store_release(self.words, W_FORWARDS, count)

    def forwards(self) -> int:
        return self.ordering.load_acquire(self.words, W_FORWARDS)

    # -- split micro-batch lockstep (ds_odc.runtime.lockstep.SplitLockstep) ---------------------------
    def set_split_key(self, key: int) -> None:
        """Which forward of which split micro-batch this rank has begun (an encoded, increasing key),
        published with a release store: the members of that micro-batch wait for each other's."""
        self.ordering.store_release(self.words, W_SPLIT, key)

    def split_key(self) -> int:
        return self.ordering.load_acquire(self.words, W_SPLIT)

    # -- rendezvous slots ----------------------------------------------------------------------------
    def _slot(self, parity: int) -> int:
        return SLOTS_AT + parity * (SLOT_HEADER + self.width)

    def write_round(self, seq: int, step: int, kind: int, values: torch.Tensor) -> None:
        """Payload and header with plain stores, then ``seq`` with a release store."""
        base = self._slot(seq % 2)
        n = values.numel()
        self.floats[base + SLOT_HEADER:base + SLOT_HEADER + n] = values.to(torch.float64)
        self.words[base + 1:base + SLOT_HEADER] = torch.tensor([step, kind, n], dtype=torch.int64)
        self.ordering.store_release(self.words, base, seq)

    def round_seq(self, parity: int) -> int:
        return self.ordering.load_acquire(self.words, self._slot(parity))

    def round_header(self, parity: int) -> tuple:
        """``(step, kind, length)`` of the slot (read after :meth:`round_seq` acquired it)."""
        base = self._slot(parity)
        return tuple(int(v) for v in self.words[base + 1:base + SLOT_HEADER].tolist())

    def round_payload(self, parity: int, n: int) -> torch.Tensor:
        base = self._slot(parity) + SLOT_HEADER
        return self.floats[base:base + n].clone()

    def latest_seq(self) -> int:
        return int(max(self._plain[self._slot(0)], self._plain[self._slot(1)]))

    # -- blob ----------------------------------------------------------------------------------------
    def _blob(self) -> int:
        return self._slot(2)

    def write_blob(self, data: bytes) -> None:
        if len(data) > BLOB_BYTES:
            raise ValueError(f"blob of {len(data)} bytes exceeds {BLOB_BYTES}")
        start = (self._blob() + 1) * 8
        self.bytes[start:start + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.ordering.store_release(self.words, self._blob(), len(data) + 1)  # 0 means "not written yet"

    def read_blob(self) -> Optional[bytes]:
        written = self.ordering.load_acquire(self.words, self._blob())
        if written == 0:
            return None
        start = (self._blob() + 1) * 8
        return bytes(self.bytes[start:start + written - 1].tolist())


class ControlPlane:
    """One rank's view of the group's control blocks.

    ``alive(r)`` says whether peer ``r``'s process still exists (transports pass the life-lock test;
    in-process tests pass their own). ``describe(r)`` names a peer in errors (rank, host, pid);
    ``wording`` names round kinds and activities.
    """

    def __init__(self, rank: int, blocks: List[ControlBlock], alive: Callable[[int], bool],
                 describe: Optional[Callable[[int], str]] = None, first_rank: int = 0, wording: Wording = NUMBERS):
        self.rank = rank
        self.first_rank = first_rank  # block r belongs to the job's rank first_rank + r
        self.world_size = len(blocks)
        self.blocks = blocks
        self.me = blocks[rank]
        self._alive = alive
        self._describe = describe or (lambda r: f"rank {first_rank + r}")
        self.wording = wording

    def peers(self) -> List[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def job_rank(self, peer: int) -> int:
        """The job's rank of block ``peer`` (failure records name job ranks)."""
        return self.first_rank + peer

    def alive(self, peer: int) -> bool:
        return self._alive(peer)

    def describe(self, peer: int) -> str:
        return self._describe(peer)

    def activity_text(self, peer: int) -> str:
        """What ``peer`` was last doing, in the protocol's words."""
        return self.wording.activity(*self.blocks[peer].activity())

    def failure_of(self, peer: int) -> Optional[FailureRecord]:
        block = self.blocks[peer]
        return block.read_failure() if block.state() == State.FAILED else None

    def first_failure(self) -> Optional[FailureRecord]:
        """A failure recorded by any rank (this one included): preferably one a rank recorded about
        itself, rather than one it relayed from another rank."""
        relayed = None
        for rank in range(self.world_size):
            record = self.failure_of(rank)
            if record is not None and record.origin == self.job_rank(rank):
                return record
            relayed = relayed or record
        return relayed

    def mark_failed(self, record: FailureRecord) -> None:
        """Poison the group: peers see ``record`` at their next rendezvous (first record wins)."""
        if self.me.state() != State.FAILED:
            self.me.write_failure(record)

    def failed(self) -> Optional[FailureRecord]:
        """This rank's own failure record, if it has one."""
        return self.failure_of(self.rank)
