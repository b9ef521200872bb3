"""The step rendezvous over shared control blocks: bounded, and it names the peer it waits for.

Each rank owns a small float64 control block::

    [pid, epoch_even, epoch_odd, heartbeat, data_even[width], data_odd[width]]

Round ``k`` writes its values into the data slot of parity ``k % 2``, then sets that parity's epoch
to ``k``; it is complete once every rank's epoch of that parity reaches ``k``. Two slots suffice: a
rank can only start round ``k + 2`` after every rank has *arrived* at ``k + 1``, i.e. after
everyone finished reading round ``k``. On x86-64 (TSO) a store of the epoch is visible only after
the data stores before it.

A peer whose process is gone is reported at once. A live peer is reported once it has made no
progress for ``timeout_s``: ranks bump their heartbeat on every pull and push, so a rank still
working through a long micro-batch is waited for, and only a stopped or stuck one is an error.
"""
from __future__ import annotations

import os
import time

import torch

from ds_odc.errors import ODCPeerError, ODCTimeoutError

HEADER = 4
HEARTBEAT = 3


def control_numel(width: int) -> int:
    return HEADER + 2 * width


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running (not zombie) process on this host."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False


class StepRendezvous:
    """All-to-all exchange of a small vector through the ranks' control blocks."""

    def __init__(self, rank: int, blocks: list, width: int, timeout_s: float):
        self.rank = rank
        self.blocks = blocks  # one float64 tensor per rank, blocks[rank] is ours
        self.width = width
        self.timeout_s = timeout_s
        self.round = 0
        blocks[rank][0] = float(os.getpid())

    def heartbeat(self) -> None:
        """Record progress (called on every pull and push; one store)."""
        self.blocks[self.rank][HEARTBEAT] += 1.0

    def exchange(self, values: torch.Tensor, what: str) -> torch.Tensor:
        n = values.numel()
        if n > self.width:
            raise ValueError(f"rendezvous payload of {n} values exceeds the width {self.width}")
        self.round += 1
        parity = self.round % 2
        start = HEADER + parity * self.width
        mine = self.blocks[self.rank]
        mine[start:start + n] = values.to(torch.float64)
        mine[1 + parity] = float(self.round)
        self._wait_for_all(1 + parity, what)
        return torch.stack([block[start:start + n].clone() for block in self.blocks])

    def _wait_for_all(self, epoch_index: int, what: str) -> None:
        target = float(self.round)
        pending = [r for r in range(len(self.blocks)) if r != self.rank]
        last_beat = {r: self.blocks[r][HEARTBEAT].item() for r in pending}
        last_progress = {r: time.monotonic() for r in pending}
        next_liveness_check = time.monotonic() + 0.05
        pause = 5e-6
        while pending:
            pending = [r for r in pending if self.blocks[r][epoch_index].item() < target]
            if not pending:
                return
            now = time.monotonic()
            if now >= next_liveness_check:
                next_liveness_check = now + 0.05
                for r in pending:
                    pid = int(self.blocks[r][0].item())
                    if not pid_alive(pid):
                        raise ODCPeerError(
                            f"rank {r} (pid {pid}) exited; rank {self.rank} was waiting for it at {what} "
                            f"(rendezvous round {self.round})")
                    beat = self.blocks[r][HEARTBEAT].item()
                    if beat != last_beat[r]:
                        last_beat[r], last_progress[r] = beat, now
                stalled = [r for r in pending if now - last_progress[r] > self.timeout_s]
                if stalled:
                    raise ODCTimeoutError(
                        f"rank(s) {stalled} made no progress for {self.timeout_s:.0f}s and did not reach {what}; "
                        f"rank {self.rank} waited at rendezvous round {self.round}, theirs: "
                        f"{[int(max(self.blocks[r][1].item(), self.blocks[r][2].item())) for r in stalled]}. "
                        f"A peer is stuck, or ranks called engine.step() a different number of times.")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
