"""Windows away and back: what ``engine.offload_states()`` / ``reload_states()`` do to ODC's windows.

On ZeRO-3 those calls move a rank's own buffers between the device and host memory, and nothing else
notices. On ODC two of the buffers are windows the peers reach: the parameter window (DeepSpeed's
``lp_params``) and the gradient accumulator (``lp_grads``). Moving one is therefore done by the whole
node in rounds, which :class:`Residency` runs on the step protocol's rounds (inside its ``meeting``)::

    away   round: every rank asks for the same windows; nobody pulls or pushes any more
           copy this rank's own windows into host memory; drop the mappings of peers' windows
           round: nobody maps a window that is about to be freed
           drop this rank's own windows
    back   make new windows and copy the host copies in (a failure is carried into the round)
           round: every rank brings back the same windows, and each new window exists and holds its
                  content; or every rank raises, naming the rank that could not allocate, and the
                  windows stay away (call reload_states again)
           map the peers' new windows
           (shm only) round: every rank mapped them; their files go

While a window is away, this rank's views of its own shards and gradients are views of the host copy
(:meth:`WindowStash.window`; the adapter points ZeRO-3's buffers there, as ZeRO-3's own offload does),
and a pull (parameters away), a push (gradients away), a step, or a round that reads a window refuses,
naming the call that brings them back. Content is copied, never recomputed: training after
``reload_states`` is bit for bit the training without the two calls.

What "away" frees: on a GPU the windows' device memory (after every peer closed its mapping), for a
rollout engine to use; on CPU the shared-memory pages in ``shm_dir`` (the host copy is ordinary
process memory). Both are the same path: only the transport's primitives differ. A transport that cannot
move its windows (``Transport.supports_residency`` false) is refused by name before any round.
"""
from __future__ import annotations

from typing import Callable, ContextManager, Dict, FrozenSet, Iterable, Optional, Protocol, Sequence

import torch

from ds_odc.comm.cross_node import CrossNodeLink
from ds_odc.comm.schedule import point
from ds_odc.comm.transport import Transport
from ds_odc.errors import ODCConfigError, ODCStateError
from ds_odc.runtime.round_kinds import RoundKind

_EMPTY = torch.zeros(0, dtype=torch.float64)

#: The windows a rank can move: its parameter window and its gradient accumulator.
WINDOW_KINDS = ("params", "grads")
_WORDS = {"params": "parameter window", "grads": "gradient accumulator"}


def describe(kinds: Iterable[str]) -> str:
    """``{"params", "grads"}`` -> "parameter window and gradient accumulator"."""
    names = [_WORDS[k] for k in WINDOW_KINDS if k in set(kinds)]
    return " and ".join(names) if names else "no window"


def mask(kinds: Iterable[str]) -> float:
    """The kinds as a round value: bit i for ``WINDOW_KINDS[i]``."""
    kinds = set(kinds)
    return float(sum(1 << i for i, kind in enumerate(WINDOW_KINDS) if kind in kinds))


def kinds_of(value: float) -> FrozenSet[str]:
    return frozenset(kind for i, kind in enumerate(WINDOW_KINDS) if int(value) >> i & 1)


def disagreement(rows: torch.Tensor, columns: tuple, first_rank: int = 0) -> Optional[str]:
    """None when every rank's row (``[requested, away]`` masks) equals rank 0's; else which ranks differ and how."""
    reference = rows[0]
    differing = [r for r in range(rows.shape[0]) if not torch.equal(rows[r], reference)]
    if not differing:
        return None

    def said(r: int) -> str:
        return ", ".join(f"{name} {describe(kinds_of(rows[r][i].item()))}" for i, name in enumerate(columns))

    return "; ".join(f"rank {first_rank + r}: {said(r)}" for r in [0, *differing])


class WindowStash:
    """This rank's own windows: on the transport (mapped, peers reach them) or away in host memory."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.host: Dict[str, torch.Tensor] = {}

    @property
    def away(self) -> FrozenSet[str]:
        return frozenset(self.host)

    def window(self, kind: str) -> torch.Tensor:
        """This rank's window of ``kind``: its host copy while away, else the transport's."""
        if kind in self.host:
            return self.host[kind]
        return self.transport.local_param_window() if kind == "params" else self.transport.local_grad_accumulator()

    def take(self, kinds: Iterable[str], pin_memory: bool, non_blocking: bool) -> None:
        """Copy the windows of ``kinds`` into host memory (pinned when asked and the window is on a GPU;
        ``non_blocking``: the copy may still run; the next round waits for the device)."""
        for kind in kinds:
            window = self.window(kind)
            host = torch.empty(window.shape, dtype=window.dtype, device="cpu",
                               pin_memory=pin_memory and window.is_cuda)
            host.copy_(window, non_blocking=non_blocking and window.is_cuda)
            self.host[kind] = host

    def put_back(self, kinds: Iterable[str], non_blocking: bool) -> None:
        """Copy the host copies of ``kinds`` into the transport's new windows (the host copies stay until
        :meth:`release`: the windows are not back until every rank's are)."""
        for kind in kinds:
            target = self.transport.local_param_window() if kind == "params" \
                else self.transport.local_grad_accumulator()
            target.copy_(self.host[kind], non_blocking=non_blocking and target.is_cuda)

    def release(self, kinds: Iterable[str]) -> None:
        for kind in kinds:
            self.host.pop(kind, None)


class Rounds(Protocol):
    """What :class:`Residency` borrows of the step protocol (:class:`~ds_odc.runtime.step.StepProtocol`): its
    transport and cross-node link, a meeting outside a step, and its rounds."""

    transport: Transport
    link: CrossNodeLink

    def meeting(self, what: str) -> ContextManager[None]: ...

    def round(self, kind: RoundKind, values: torch.Tensor, what: str = "") -> torch.Tensor: ...


class Residency:
    """Where this rank's windows are, and the collective calls that move them (see the module docstring).
    The step protocol owns the rounds; this object owns the stash and the order of its calls around them."""

    def __init__(self, rounds: Rounds):
        self.rounds = rounds
        self.stash = WindowStash(rounds.transport)

    @property
    def away(self) -> FrozenSet[str]:
        return self.stash.away

    def require(self, kinds: set, what: str) -> None:
        """Raise :class:`ODCStateError` when ``what`` needs a window that is away (the caller fails the group)."""
        away = self.stash.away & kinds
        if away:
            raise ODCStateError(f"{what} needs this rank's {describe(away)}, which engine.offload_states() moved to "
                                "host memory: call engine.reload_states() on every rank first")

    def _supported(self, what: str) -> None:
        transport = self.rounds.transport
        if not transport.supports_residency:
            raise ODCConfigError(f"{what}: the {transport.name} transport cannot move its windows off the device "
                                 "(nothing was moved, no rank met): leave the states where they are")

    def offload(self, kinds: frozenset, pin_memory: bool, non_blocking: bool, what: str) -> frozenset:
        """Move this rank's windows of ``kinds`` to host memory, with every rank of the job (collective).
        Windows already away are left as they are; returns the kinds moved now. Ranks that ask for different
        windows fail the group, naming them."""
        self._supported(what)
        rounds, transport = self.rounds, self.rounds.transport
        with rounds.meeting(what):
            kinds = frozenset(kinds) - self.stash.away
            self._agree(RoundKind.WINDOWS_AWAY, ("asked to move", "had away"), [kinds, self.stash.away], what)
            self.stash.take(kinds, pin_memory, non_blocking)
            point("windows.away")
            transport.drop_peer_windows(kinds)
            rounds.round(RoundKind.WINDOWS_AWAY, _EMPTY, what)  # nobody maps a window about to be freed
            transport.drop_own_windows(kinds)
        return kinds

    def reload(self, non_blocking: bool, what: str) -> frozenset:
        """Bring every window that is away back, with every rank of the job (collective): new windows,
        their content copied in from the host, every peer's mapped. Returns the kinds brought back.

        A rank that cannot allocate (a device or ``shm_dir`` still full) makes every rank raise, naming
        it, with the windows still away and the group intact: free the memory and call it again."""
        self._supported(what)
        rounds, transport = self.rounds, self.rounds.transport
        kinds, refused, made = self.stash.away, None, None
        with rounds.meeting(what):
            if kinds:  # made and filled before the one round, so that peers may map them right after it
                try:
                    transport.recreate_own_windows(kinds)
                    self.stash.put_back(kinds, non_blocking)
                except Exception as err:  # noqa: BLE001 - every rank learns of it in the round
                    made = err
            rows = self._agree(RoundKind.WINDOWS_BACK, ("had away",), [kinds], what,
                               extra=[float(made is not None)], on_disagreement=lambda: self._discard_new(kinds))
            failed = [r for r in range(rows.shape[0]) if rows[r][1] != 0]  # job ranks
            if failed:
                self._discard_new(kinds)
                refused = made or ODCStateError(
                    f"rank(s) {failed} could not allocate their {describe(kinds)} again ({what}): every rank keeps "
                    "them in host memory; free the memory they need (each failing rank's error says how much and "
                    "where) and call engine.reload_states() again on every rank")
            elif kinds:
                transport.map_peer_windows(kinds)
                if transport.peers_map_by_name:  # their names go only once every rank mapped them
                    rounds.round(RoundKind.WINDOWS_BACK, _EMPTY, what)
                transport.windows_mapped(kinds)
                self.stash.release(kinds)
        if refused is not None:
            raise refused
        return kinds

    def _discard_new(self, kinds: frozenset) -> None:
        """A reload that did not happen: this rank's new windows (if it made them) go, the host copies stay."""
        if kinds:
            self.rounds.transport.drop_own_windows(kinds)

    def _agree(self, kind: RoundKind, columns: tuple, values: list, what: str, extra: Sequence[float] = (),
               on_disagreement: Optional[Callable[[], None]] = None) -> torch.Tensor:
        """A round whose values (masks of window kinds) every rank of the job must give alike, carrying
        ``extra`` values besides (not compared); returns the job's rows."""
        payload = torch.tensor([mask(v) for v in values] + list(extra), dtype=torch.float64)
        rows = self.rounds.link.job_rows(self.rounds.round(kind, payload, what))
        differing = disagreement(rows[:, :len(values)], columns)
        if differing is not None:
            if on_disagreement is not None:
                on_disagreement()
            raise ODCStateError(f"{what} was called differently on the ranks ({differing}): call it on every rank "
                                "with the same arguments")
        return rows
