"""Allocating one engine's shared-memory files on a node: all or nothing, and nothing left behind.

:class:`NodeAllocation` runs the start-up protocol both transports share::

    plan     collective: every rank's host, pid, shm free space and needs; one session name;
             refusals every rank agrees on (several hosts, too little room in shm_dir);
             then the sweep of dead jobs' files
    create   local, SIGTERM/SIGINT-guarded: lock file (life lock held), control block, windows
    agree    collective: every rank's outcome; any failure -> every rank raises, naming it
    map      local: open every peer's lock file, map every peer's control block (and windows)
    agree    collective
    unlink   every rank removes its own files: from here on, nothing can be left in shm_dir

A failing local step does not raise at once: its error is carried into the next ``agree``, which
every rank reaches, so every rank learns of it in the same collective instead of waiting for a
peer that has given up. Any failure, here or in a peer, removes every file of the session (every
rank's: the session is dead), and a dead or stuck peer is named from its lock file and control
block. Collectives here wait as long as the process group lets them (its timeout, the same bound
ODC's own rounds use by default).
"""
from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as tdist

from ds_odc.comm.control import ControlBlock, State, block_words
from ds_odc.comm.locks import LockFile, holds_life_lock
from ds_odc.comm.ordering import memory_ordering
from ds_odc.comm.segments import (
    CleanupOnSignal,
    SegmentSpaceError,
    create_reserved,
    free_bytes,
    map_segment,
    segment_path,
    session_paths,
    sweep_orphans,
    unlink_quietly,
)
from ds_odc.comm.topology import Topology
from ds_odc.errors import ODCConfigError, ODCPeerError

SHM_FIELD = "zero_optimization.odc.shm_dir"


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def no_room(shm_dir: str, who: str, kind: str, nbytes: int) -> ODCConfigError:
    """The error for a segment ``shm_dir`` has no room for: the directory, the bytes, what is free, the fix."""
    return ODCConfigError(
        f"{SHM_FIELD}={shm_dir!r}: no room for {who}'s {kind} segment ({format_bytes(nbytes)}; "
        f"{format_bytes(free_bytes(shm_dir))} free now). Give the job a larger shared-memory filesystem "
        f"(docker run --shm-size=...) or point {SHM_FIELD} at a tmpfs with room.")


@dataclass(frozen=True)
class RankInfo:
    """What one rank tells the others before anything is created."""

    host: str
    pid: int
    shm_device: int
    free_bytes: int
    session: str


@dataclass(frozen=True)
class Outcome:
    """One rank's result of a local allocation step, for :meth:`NodeAllocation.agree`."""

    error: Optional[str] = None
    config_error: bool = False


class NodeAllocation:
    """The start-up protocol of one transport's shm files (see the module docstring).

    Every rank creates a lock file, a control block whose rounds carry up to ``width`` values, and
    the segments of ``windows`` (kind -> bytes, e.g. ``{"params": ..., "grads": ...}``; empty when
    the windows live elsewhere, as GPU memory does); every rank creates the same kinds and sizes.
    """

    def __init__(self, rank: int, world_size: int, shm_dir: str, width: int, windows: Dict[str, int], group=None,
                 first_rank: int = 0):
        self.rank = rank  # within ``group``: the ranks of one node
        self.first_rank = first_rank
        self.world_size = world_size
        self.shm_dir = shm_dir
        self.width = width
        self.sizes = {"ctrl": block_words(width) * 8, **windows}
        self.group = group
        self.infos: List[RankInfo] = []
        self.session = ""
        self.lock: Optional[LockFile] = None
        self.peer_locks: List[Optional[LockFile]] = []
        self.guard: Optional[CleanupOnSignal] = None
        self._pending: Optional[BaseException] = None
        self._created: List[str] = []

    def name(self, rank: int) -> str:
        """How errors name the group's rank ``rank``: by its rank in the job."""
        return f"rank {self.first_rank + rank}"

    # -- plan (collective, nothing created yet) ----------------------------------------------------------
    def plan(self) -> None:
        me = RankInfo(socket.gethostname(), os.getpid(), os.stat(self.shm_dir).st_dev, free_bytes(self.shm_dir),
                      uuid.uuid4().hex[:12])
        infos: List[Any] = [None] * self.world_size  # every rank's RankInfo, once gathered
        tdist.all_gather_object(infos, me, group=self.group)
        self.infos = infos
        self.session = infos[0].session
        topology = Topology.from_hosts([info.host for info in infos])
        if topology.node_count != 1:
            hosts = sorted({info.host for info in infos})
            raise ODCConfigError(f"one ODC transport serves the ranks of one host, but these span hosts {hosts}: "
                                 f"{topology.describe()}; give it the group of one node's ranks")
        self._check_capacity()
        sweep_orphans(self.shm_dir)

    def _check_capacity(self) -> None:
        need = sum(self.sizes.values())
        sharing = [info for info in self.infos if info.shm_device == self.infos[self.rank].shm_device]
        total, free = need * len(sharing), min(info.free_bytes for info in sharing)
        if total > free:
            parts = ", ".join(f"{kind} {format_bytes(nbytes)}" for kind, nbytes in self.sizes.items())
            raise ODCConfigError(
                f"{SHM_FIELD}={self.shm_dir!r} has {format_bytes(free)} free, but the {len(sharing)} ranks on "
                f"{self.infos[self.rank].host} need {format_bytes(total)} there ({format_bytes(need)} each: {parts}). "
                "Give the job a larger shared-memory filesystem (docker run --shm-size=..., a Kubernetes emptyDir "
                f"with medium: Memory and a sizeLimit, mount -o remount,size=... {self.shm_dir}) or point {SHM_FIELD} "
                "at a tmpfs with room.")

    def allocate(self, create: Callable[[], object], map_peers: Callable[[], None], release: Callable[[], None],
                 creating: str, mapping: str) -> None:
        """The whole protocol of the module docstring, for a transport: :meth:`plan`, then under the
        signal guard ``create`` (this rank's files and windows), agree, ``map_peers``, agree, unlink.
        On any failure every file of the session is removed, ``release()`` drops what this rank holds,
        and the error is raised (on every rank: the agreements carry it). ``creating`` / ``mapping``
        say what a failing rank was doing, in the errors."""
        self.plan()
        try:
            with self.guarded():
                self.run(create)
                self.agree(creating)
                self.run(map_peers)
                self.agree(mapping)
                self.unlink_own()
        except BaseException:
            self.abort()
            release()
            raise

    # -- local steps: errors are held for the next agree() ----------------------------------------------
    def run(self, step: Callable[[], object]) -> None:
        """Run a local step; an Exception is kept for :meth:`agree` (other exceptions propagate)."""
        if self._pending is not None:
            return
        try:
            step()
        except Exception as err:  # noqa: BLE001 - reported to every rank by agree()
            self._pending = err

    def path(self, rank: int, kind: str) -> str:
        return segment_path(self.shm_dir, self.session, rank, kind)

    def guarded(self) -> CleanupOnSignal:
        """The signal guard for the create..unlink window: ``with allocation.guarded(): ...``."""
        self.guard = CleanupOnSignal()
        return self.guard

    def create_own_files(self, timeout_s: float) -> ControlBlock:
        """Lock file first (life lock held before it is visible), then the control block, then each
        window segment, reserved; the block says READY once all exist."""
        self.lock = LockFile.create(self.path(self.rank, "lock"), self.rank, timeout_s)
        self._track(self.path(self.rank, "lock"))
        self._create_segment("ctrl")  # first of ``sizes``
        block = self.map_control(self.rank)
        block.init(os.getpid())
        for kind in self.sizes:
            if kind != "ctrl":
                self._create_segment(kind)
        block.set_state(State.READY)
        return block

    def _create_segment(self, kind: str) -> None:
        path = self.path(self.rank, kind)
        self._track(path)
        try:
            create_reserved(path, self.sizes[kind])
        except SegmentSpaceError as err:
            raise no_room(self.shm_dir, self.name(self.rank), kind, err.nbytes) from None

    def _track(self, path: str) -> None:
        self._created.append(path)
        if self.guard is not None:
            self.guard.track([path])

    def map_control(self, rank: int) -> ControlBlock:
        return ControlBlock(map_segment(self.path(rank, "ctrl"), block_words(self.width), torch.int64), self.width,
                            memory_ordering())

    def open_peer_locks(self, timeout_s: float) -> None:
        self.peer_locks = [self.lock if r == self.rank else LockFile.open(self.path(r, "lock"), r, timeout_s)
                           for r in range(self.world_size)]

    # -- agree (collective) --------------------------------------------------------------------------------
    def agree(self, doing: str) -> None:
        """Every rank's outcome of the local steps since the last agree; any failure raises everywhere."""
        pending, self._pending = self._pending, None
        mine = Outcome() if pending is None else Outcome(f"{type(pending).__name__}: {pending}",
                                                         isinstance(pending, ODCConfigError))
        outcomes: List[Any] = [None] * self.world_size  # every rank's Outcome, once gathered
        try:
            tdist.all_gather_object(outcomes, mine, group=self.group)
        except Exception as err:  # noqa: BLE001 - a peer left or stalled: name it from its files
            raise ODCPeerError(f"{self.name(self.rank)} lost its peers while {doing}: {self.diagnose()}; "
                               f"the process group reported: {err}") from (pending or err)
        if pending is not None:
            raise pending
        failed = {r: o for r, o in enumerate(outcomes) if o.error is not None}
        if failed:
            text = "; ".join(f"{self.name(r)} ({self.infos[r].host}, pid {self.infos[r].pid}) failed while {doing}: "
                             f"{o.error}" for r, o in failed.items())
            error_class = ODCConfigError if all(o.config_error for o in failed.values()) else ODCPeerError
            raise error_class(text)

    def diagnose(self) -> str:
        """Each peer's state, read from its files: exited, failed, still creating, or ready."""
        notes = []
        for r in range(self.world_size):
            if r == self.rank:
                continue
            who = f"{self.name(r)} (pid {self.infos[r].pid})" if self.infos else self.name(r)
            notes.append(f"{who} {self._peer_state(r)}")
        return "; ".join(notes)

    def _peer_state(self, rank: int) -> str:
        lock_path = self.path(rank, "lock")
        peer_lock = self.peer_locks[rank] if self.peer_locks else None
        if peer_lock is not None:
            alive = peer_lock.owner_alive()
        elif os.path.exists(lock_path):
            fd = os.open(lock_path, os.O_RDWR)
            try:
                alive = holds_life_lock(fd)
            finally:
                os.close(fd)
        else:
            return "had not created its files (not started, or exited before)"
        if not alive:
            return "exited (killed or crashed)"
        try:
            block = self.map_control(rank)
        except (OSError, RuntimeError):
            return "is alive but its control block is unreadable"
        state = block.state()
        if state == State.FAILED:
            return "failed: " + block.read_failure().error
        return "is alive but still creating its windows (stopped or stuck?)" if state < State.READY else \
            "is alive and ready"

    # -- the end -------------------------------------------------------------------------------------------
    def unlink_own(self) -> None:
        """Every rank holds its mappings: remove this rank's files (the lock file last)."""
        for path in sorted(self._created, key=lambda p: p.endswith("_lock")):
            unlink_quietly(path)
        self._created.clear()

    def abort(self) -> None:
        """The session is dead: remove every rank's files of it, release this rank's locks."""
        for path in session_paths(self.shm_dir, self.session) + self._created:
            unlink_quietly(path)
        self._created.clear()
        for lock in {id(lk): lk for lk in self.peer_locks + [self.lock] if lk is not None}.values():
            lock.close()
