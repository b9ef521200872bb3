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
as norms. While waiting, the rank watches every pending peer (:class:`~ds_odc.comm.peer_watch.PeerWatch`):
a failure record, death, closing, or no progress for ``timeout_s``.

A failed round is final: the rendezvous refuses further rounds (a retried round would pair with
whatever round the peers are in).
"""
from __future__ import annotations

from typing import Optional

import torch

from ds_odc.comm.backoff import Backoff
from ds_odc.comm.control import ControlPlane
from ds_odc.comm.failure import FailureRecord
from ds_odc.comm.peer_watch import PeerWatch
from ds_odc.comm.schedule import point
from ds_odc.errors import ODCPeerError


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
        point("round.write")
        me.write_round(seq, step, int(kind), values)
        try:
            self._wait(seq, step, int(kind), n, what or self.plane.wording.round_name(int(kind)))
        except ODCPeerError as err:
            self.broken = err
            raise
        self.seq = seq
        point("round.read")
        parity = seq % 2
        return torch.stack([block.round_payload(parity, n) for block in self.plane.blocks])

    # -- waiting ---------------------------------------------------------------------------------------
    def _wait(self, seq: int, step: int, kind: int, n: int, what: str) -> None:
        plane, parity = self.plane, seq % 2
        here = f"rank {plane.job_rank(plane.rank)} was at round {seq} ({what}, step {step})"
        pending = plane.peers()
        watch = PeerWatch(plane, pending, self.timeout_s, step, here)
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
            watch.raise_on_failures(range(plane.world_size) if not pending else pending)
            if not pending:
                return
            watch.poll(pending)
            backoff.sleep()

    def _check_header(self, peer: int, theirs: tuple, mine: tuple, seq: int, here: str) -> None:
        if theirs == mine:
            return
        step, kind, n = theirs
        kind_text = self.plane.wording.round_name(kind)
        message = (f"{self.plane.describe(peer)} is at round {seq} ({kind_text}, step {step}, {n} values) "
                   f"where {here.replace('was at', 'is at')} with {mine[2]} values: the ranks called different things "
                   "(e.g. engine.step() or save_checkpoint() on some ranks only, or a different number of times)")
        PeerWatch.fail(message, FailureRecord(self.plane.job_rank(peer), step, kind_text,
                                              "rounds out of step: " + message))
