"""The transport boundary: one-sided windows, plus the control plane every rank of a node shares.

The runtime sees only this interface. A transport owns, for every rank of the data-parallel group,

* a **parameter window** of ``param_numel`` elements in the compute dtype, which peers *read*
  (pull) without the owner taking part;
* a **gradient accumulator** of ``grad_numel`` fp32 (or fp64) elements, which peers *add into* (push)
  without the owner taking part, correctly under concurrent pushes;
* a **control plane** (:mod:`ds_odc.comm.control`): typed rendezvous rounds
  (:meth:`Transport.exchange`, the only synchronisation), each rank's liveness, progress and
  activity, and the group's failure record (:meth:`Transport.mark_failed`), which every peer sees
  at its next round.

Allocation is separate from transfer (as in FSDP2's ``Comm``): :meth:`allocate` runs once per
engine, at initialisation, and may use collectives; nothing after it does. Transfers come one at a
time (:meth:`read`, :meth:`accumulate`) or batched with a completion handle (:meth:`read_many`,
:meth:`accumulate_many`, :mod:`ds_odc.comm.batch`).
"""
from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

import torch

from ds_odc.comm.batch import COMPLETED, Completion, Transfer
from ds_odc.comm.control import ControlBlock, ControlPlane, State
from ds_odc.comm.failure import FailureRecord
from ds_odc.comm.rendezvous import Rendezvous
from ds_odc.comm.wording import NUMBERS, Wording
from ds_odc.errors import ODCStateError


@dataclass(frozen=True)
class WindowSpec:
    """Sizes of one rank's windows; identical on every rank (ZeRO-3's layout guarantees it)."""

    param_numel: int
    param_dtype: torch.dtype
    grad_numel: int
    exchange_width: int = 32
    grad_dtype: torch.dtype = torch.float32


class Transport(abc.ABC):
    """One-sided windows of a data-parallel group. See the module docstring for the contract."""

    name: str = "abstract"

    def __init__(self, rank: int, world_size: int, timeout_s: float, first_rank: int = 0, wording: Wording = NUMBERS):
        self.rank = rank  # among the ranks of this node (the transport's group)
        self.world_size = world_size
        self.first_rank = first_rank  # the job's rank of this node's rank 0: errors name job ranks
        self.timeout_s = timeout_s
        self.wording = wording  # how errors name round kinds and activities (the protocol's words)
        self.exchanges = 0  # rendezvous rounds so far; tests count them
        self._spec: Optional[WindowSpec] = None  # set by allocate(): see spec
        self.plane: Optional[ControlPlane] = None  # from allocate() to close(): see control_plane
        self.rendezvous: Optional[Rendezvous] = None  # likewise: see active_rendezvous

    # -- windows (per transport) ---------------------------------------------------------------------
    @property
    def spec(self) -> WindowSpec:
        """The sizes :meth:`allocate` made the windows with."""
        if self._spec is None:
            raise ODCStateError(f"the {self.name} transport of rank {self.job_rank} has no windows: allocate() has "
                                "not run")
        return self._spec

    @abc.abstractmethod
    def allocate(self, spec: WindowSpec) -> None:
        """Create this rank's windows and map every peer's. Collective; called once. All or nothing:
        if any rank fails, every rank raises (naming it) and nothing is left allocated."""

    @abc.abstractmethod
    def local_param_window(self) -> torch.Tensor:
        """This rank's parameter window (its shards, compute dtype). Peers read it at any time
        except between the step's fence and its publish, so the owner writes it only then."""

    @abc.abstractmethod
    def local_grad_accumulator(self) -> torch.Tensor:
        """This rank's fp32 accumulator. Peers add into it until the step fence."""

    @abc.abstractmethod
    def read(self, owner: int, offset: int, out: torch.Tensor) -> None:
        """Copy ``out.numel()`` elements of ``owner``'s parameter window, from ``offset``, into ``out``."""

    @abc.abstractmethod
    def accumulate(self, owner: int, offset: int, grad: torch.Tensor) -> None:
        """Add ``grad`` (any float dtype) into ``owner``'s accumulator at ``offset``, in fp32.
        Returns once the addition is complete and visible to the owner after the next fence."""

    def read_many(self, reads: Sequence[Transfer]) -> Completion:
        """:meth:`read` of every :class:`~ds_odc.comm.batch.Transfer` in ``reads`` (several owners and
        parameters, e.g. all shards of a module) in one call; the destinations are valid after the
        returned handle's ``wait()``. This default reads one by one and completes eagerly; transports
        override it to do the batch in one pass or one launch."""
        for transfer in reads:
            self.read(transfer.owner, transfer.offset, transfer.tensor)
        return COMPLETED

    def accumulate_many(self, pushes: Sequence[Transfer]) -> Completion:
        """:meth:`accumulate` of every transfer in ``pushes`` in one call, with the same guarantees
        (added exactly once, visible to the owner after the next fence); the sources may be reused
        after the handle's ``wait()``. This default adds one by one and completes eagerly."""
        for transfer in pushes:
            self.accumulate(transfer.owner, transfer.offset, transfer.tensor)
        return COMPLETED

    def push_guard(self, owner: int, offset: int, numel: int) -> contextlib.AbstractContextManager:
        """What a push into ``owner``'s accumulator over ``[offset, offset + numel)`` holds while it adds
        (a context manager). ``accumulate`` takes it, and fault injection takes it too, so that a rank
        can be stopped or killed exactly where a pusher is most dangerous to its peers: the contract is
        that a holder that dies never blocks another rank's push for long (the shm transport's stripe
        locks are released by the kernel), and one that is merely stopped makes peers' pushes time out
        naming the owner. Transports whose pushes hold nothing (atomic adds) keep this default."""
        return contextlib.nullcontext()

    #: Whether peers find windows made again by a name that must go once every rank mapped them (shm's files):
    #: the reload then takes a second round before :meth:`windows_mapped`.
    peers_map_by_name: bool = False
    #: Whether this transport can move its windows off the device and back (the calls below); one that cannot
    #: keeps False, and ``engine.offload_states()`` is refused by name before any round.
    supports_residency: bool = False

    # -- windows away and back (engine.offload_states / reload_states) -----------------------------------
    # The runtime's rounds order these calls on every rank of the node (see ds_odc.runtime.residency):
    #   away:  [round: nobody reads or adds any more]  drop_peer_windows  [round]  drop_own_windows
    #   back:  recreate_own_windows  [round: every new window exists and holds its content]  map_peer_windows
    #          [round, where peers_map_by_name: every rank mapped them]  windows_mapped
    # ``kinds`` names windows: "params" (the parameter window) and/or "grads" (the accumulator). A transport
    # that cannot move its windows keeps these defaults and ``supports_residency`` False: the runtime then
    # refuses offload_states by name before any round, so these are never reached.
    def drop_peer_windows(self, kinds: Collection[str]) -> None:
        """Forget this rank's mappings of every peer's windows of ``kinds``."""
        raise NotImplementedError(f"the {self.name} transport cannot move its windows off the device")

    def drop_own_windows(self, kinds: Collection[str]) -> None:
        """Release this rank's own windows of ``kinds`` (no peer maps them any more); the memory returns
        to the device (or the shm directory) once the caller's views of them are gone. Also discards
        windows :meth:`recreate_own_windows` made that peers have not mapped yet."""
        raise NotImplementedError(f"the {self.name} transport cannot move its windows off the device")

    def recreate_own_windows(self, kinds: Collection[str]) -> None:
        """New zeroed windows of ``kinds``, of the sizes :meth:`allocate` made, published for peers to map
        after the next round. Capacity is checked here (an error naming the device or directory, the
        bytes and the fix); on any failure nothing new is left."""
        raise NotImplementedError(f"the {self.name} transport cannot move its windows off the device")

    def map_peer_windows(self, kinds: Collection[str]) -> None:
        """Map every peer's windows of ``kinds`` that :meth:`recreate_own_windows` published."""
        raise NotImplementedError(f"the {self.name} transport cannot move its windows off the device")

    def windows_mapped(self, kinds: Collection[str]) -> None:  # noqa: B027 - most transports have nothing to drop
        """Every rank mapped the new windows: drop whatever let peers find them (shm: the files)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release windows, files and descriptors (this rank's life lock last). Idempotent."""

    # -- control plane (shared by every transport) -------------------------------------------------------
    @property
    def control_plane(self) -> ControlPlane:
        """:attr:`plane`, which exists from :meth:`allocate` to :meth:`close`; outside, an error saying so."""
        if self.plane is None:
            raise self._no_control_plane()
        return self.plane

    @property
    def active_rendezvous(self) -> Rendezvous:
        """:attr:`rendezvous` (this rank's rounds over the plane), from :meth:`allocate` to :meth:`close`."""
        if self.rendezvous is None:
            raise self._no_control_plane()
        return self.rendezvous

    def _no_control_plane(self) -> ODCStateError:
        return ODCStateError(f"the {self.name} transport of rank {self.job_rank} has no control plane: allocate() "
                             "has not run, or close() has")

    @property
    def job_rank(self) -> int:
        """This rank's rank in the job (what errors and failure records name; ``ControlPlane.job_rank``
        maps a peer's block the same way)."""
        return self.first_rank + self.rank

    def exchange(self, kind: int, step: int, values: torch.Tensor, what: str = "") -> torch.Tensor:
        """Rendezvous round ``kind`` of ``step``: contribute ``values`` (1-D, at most ``exchange_width``)
        and return the ``[world_size, len(values)]`` float64 rows, row r from rank r. A peer that
        failed, died, closed, stalled for ``timeout_s`` or is at another round raises
        :class:`~ds_odc.errors.ODCPeerError` naming it (see :mod:`ds_odc.comm.rendezvous`)."""
        self.exchanges += 1
        return self.active_rendezvous.exchange(kind, step, values.to("cpu", torch.float64), what)

    def heartbeat(self) -> None:
        """Tell peers waiting at a rendezvous that this rank is still making progress."""
        self.control_plane.me.heartbeat()

    def note_activity(self, activity: int, step: int, count: int = 0) -> None:
        """Record what this rank is doing (peers' errors quote it)."""
        self.control_plane.me.set_activity(activity, step, count)

    def mark_failed(self, record: FailureRecord) -> None:
        """Poison the group: every peer raises ``record`` at its next rendezvous."""
        if self.plane is not None:
            self.plane.mark_failed(record)

    def recorded_failure(self) -> Optional[FailureRecord]:
        """A failure any rank of the group has recorded, or None."""
        return self.plane.first_failure() if self.plane is not None else None

    def _start_plane(self, blocks: list[ControlBlock], alive, describe, width: int) -> None:
        """Every rank has mapped every window: this rank is RUNNING, and its rounds go through ``blocks``."""
        blocks[self.rank].set_state(State.RUNNING)
        self.plane = ControlPlane(self.rank, blocks, alive, describe, self.first_rank, self.wording)
        self.rendezvous = Rendezvous(self.plane, width, self.timeout_s)

    def say_closed(self) -> None:
        """Peers waiting for this rank raise at once: it will not come (unless FAILED: the record stays)."""
        if self.plane is not None and self.plane.me.state() != State.FAILED:
            self.plane.me.set_state(State.CLOSED)

    def _close_plane(self) -> None:
        """Say CLOSED and drop the control plane."""
        self.say_closed()
        self.plane = None
        self.rendezvous = None
