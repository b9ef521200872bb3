"""The ``shm`` transport: one-sided windows in shared memory, for the ranks of one host (CPU).

Per rank: a parameter window (compute dtype), a gradient accumulator (fp32 or fp64), a control
block and a lock file (liveness, accumulator stripes), all created, reserved and mapped by
:class:`~ds_odc.comm.allocation.NodeAllocation` and unlinked as soon as every rank has mapped them.

* pull  = ``out.copy_(peer_window[offset:offset+n])``: a plain read of the peer's pages;
* push  = for each stripe touched: lock, ``peer_acc[a:b].add_(grad)``, unlock. A gradient in
  another dtype (bf16) is converted one stripe at a time: staging is at most one stripe. The
  lock and unlock are system calls, so the adds are ordered before the pusher's next fence round;
* batched (``read_many`` / ``accumulate_many``): the same copies and adds, done in one loop when
  called, with each accumulator stripe locked once per batch for every piece that falls into it;
* step  = typed rounds over the control blocks (:mod:`ds_odc.comm.rendezvous`);
* windows away and back (``engine.offload_states``): dropping the mappings frees the pages (the files
  were unlinked at allocation); windows made again are new files of a new generation of the session,
  under a lock file of their own (so a sweep never takes them for a dead rank's), reserved, mapped by
  every peer after a round and unlinked after the next one.
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Collection, List, Optional, Sequence

import torch

from ds_odc.comm import schedule
from ds_odc.comm.allocation import NodeAllocation, no_room
from ds_odc.comm.batch import COMPLETED, Completion, Transfer
from ds_odc.comm.locks import LockFile
from ds_odc.comm.segments import (
    CleanupOnSignal,
    SegmentSpaceError,
    create_reserved,
    map_segment,
    segment_path,
    unlink_quietly,
)
from ds_odc.comm.transport import Transport, WindowSpec
from ds_odc.comm.wording import NUMBERS, Wording


class ShmTransport(Transport):
    name = "shm"
    peers_map_by_name = True  # windows made again are files, unlinked once every peer mapped them
    supports_residency = True

    def __init__(self, rank: int, world_size: int, timeout_s: float, shm_dir: str = "/dev/shm",
                 stripe_numel: int = 1 << 20, group=None, first_rank: int = 0, wording: Wording = NUMBERS):
        super().__init__(rank, world_size, timeout_s, first_rank, wording)
        self.shm_dir = shm_dir
        self.stripe_numel = stripe_numel
        self.group = group
        self._param_windows: list = []
        self._grad_windows: list = []
        self._locks: list = []
        self._blocks: list = []
        self._closed = False
        self._session = ""
        self._generation = 0  # windows made again so far (engine.reload_states)
        self._new_files: List[str] = []  # this rank's files of the newest generation, until every peer mapped them
        self._new_lock: Optional[LockFile] = None
        self._new_guard: Optional[CleanupOnSignal] = None
        # POSIX record locks exclude processes, not threads of one: where a thread serves pushes from other
        # nodes (ds_odc.comm.remote) beside the training thread's own, this excludes them from each other
        self._adding = threading.Lock()

    # -- allocation (collective, once) ---------------------------------------------------------
    def allocate(self, spec: WindowSpec) -> None:
        windows = {"params": spec.param_numel * _itemsize(spec.param_dtype),
                   "grads": spec.grad_numel * _itemsize(spec.grad_dtype)}
        allocation = NodeAllocation(self.rank, self.world_size, self.shm_dir, spec.exchange_width, windows,
                                    self.group, self.first_rank)
        allocation.allocate(create=lambda: allocation.create_own_files(self.timeout_s),
                            map_peers=lambda: self._map_every_rank(allocation, spec), release=self._forget_windows,
                            creating="creating its shared-memory windows", mapping="mapping its peers' windows")
        self._start_plane(self._blocks, lambda r: self._locks[r].owner_alive(),
                          lambda r: f"{allocation.name(r)} (pid {allocation.infos[r].pid})", spec.exchange_width)
        self._spec, self._session = spec, allocation.session

    def _forget_windows(self) -> None:
        self._param_windows.clear()
        self._grad_windows.clear()
        self._blocks.clear()
        self._closed = True

    def _map_every_rank(self, allocation: NodeAllocation, spec: WindowSpec) -> None:
        allocation.open_peer_locks(self.timeout_s)
        self._locks = allocation.peer_locks
        self._blocks = [allocation.map_control(r) for r in range(self.world_size)]
        for peer in range(self.world_size):
            self._param_windows.append(map_segment(allocation.path(peer, "params"), spec.param_numel, spec.param_dtype))
            self._grad_windows.append(map_segment(allocation.path(peer, "grads"), spec.grad_numel, spec.grad_dtype))

    # -- one-sided access ------------------------------------------------------------------------
    def local_param_window(self) -> torch.Tensor:
        return self._param_windows[self.rank]

    def local_grad_accumulator(self) -> torch.Tensor:
        return self._grad_windows[self.rank]

    def read(self, owner: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(self._param_windows[owner].narrow(0, offset, out.numel()))

    def read_many(self, reads: Sequence[Transfer]) -> Completion:
        """Every copy in one loop, without per-read dispatch; the copies are done when it returns."""
        windows = self._param_windows
        for index, transfer in enumerate(reads):
            out = transfer.tensor
            out.copy_(windows[transfer.owner].narrow(0, transfer.offset, out.numel()).view(out.shape))
            if index == 0:
                schedule.point("pull.inside")
        return COMPLETED

    def accumulate(self, owner: int, offset: int, grad: torch.Tensor) -> None:
        accumulator = self._grad_windows[owner]
        grad = _on_host(grad).reshape(-1)
        for position, done, count in self._stripe_pieces(offset, grad.numel()):
            with self.push_guard(owner, position, count):
                accumulator.narrow(0, position, count).add_(grad.narrow(0, done, count))

    def accumulate_many(self, pushes: Sequence[Transfer]) -> Completion:
        """Each stripe of each owner is locked once for all the pieces that fall into it (one lock and
        one unlock system call per stripe touched, instead of per piece), in stripe order."""
        pieces = defaultdict(list)  # (owner, stripe) -> [(position, source piece)]
        for transfer in pushes:
            grad = _on_host(transfer.tensor).reshape(-1)
            for position, done, count in self._stripe_pieces(transfer.offset, grad.numel()):
                pieces[(transfer.owner, position // self.stripe_numel)].append((position, grad.narrow(0, done, count)))
        for (owner, stripe), adds in sorted(pieces.items(), key=lambda item: item[0]):
            accumulator = self._grad_windows[owner]
            with self.push_guard(owner, stripe * self.stripe_numel, 1):
                for position, piece in adds:
                    accumulator.narrow(0, position, piece.numel()).add_(piece)
        return COMPLETED

    @contextlib.contextmanager
    def push_guard(self, owner: int, offset: int, numel: int):
        """The stripe locks of ``owner``'s accumulator covering the range, taken in stripe order (so two
        guards over overlapping ranges cannot deadlock) and released in reverse."""
        locks = self._locks[owner]
        stripes = range(offset // self.stripe_numel, (offset + max(numel, 1) - 1) // self.stripe_numel + 1)
        taken = []
        with self._adding:
            try:
                for stripe in stripes:
                    locks.acquire(stripe)
                    taken.append(stripe)
                schedule.point("stripe.locked")
                yield
            finally:
                for stripe in reversed(taken):
                    locks.release(stripe)

    def _stripe_pieces(self, offset: int, numel: int):
        """``(position, offset into the source, count)`` of a range split on stripe boundaries.

        >>> ShmTransport(0, 1, 1.0, stripe_numel=4)._stripe_pieces(3, 6)
        [(3, 0, 1), (4, 1, 4), (8, 5, 1)]
        """
        pieces, done = [], 0
        while done < numel:
            position = offset + done
            count = min(numel - done, (position // self.stripe_numel + 1) * self.stripe_numel - position)
            pieces.append((position, done, count))
            done += count
        return pieces

    # -- windows away and back (see Transport) --------------------------------------------------------
    def _windows(self, kind: str) -> list:
        return {"params": self._param_windows, "grads": self._grad_windows}[kind]

    def _sizes(self, kind: str) -> tuple:
        spec = self.spec
        return (spec.param_numel, spec.param_dtype) if kind == "params" else (spec.grad_numel, spec.grad_dtype)

    def _path(self, rank: int, kind: str) -> str:
        """A file of the newest generation: the session's name with the generation appended (still hex)."""
        return segment_path(self.shm_dir, f"{self._session}{self._generation:04x}", rank, kind)

    def drop_peer_windows(self, kinds: Collection[str]) -> None:
        for kind in kinds:
            windows = self._windows(kind)
            for peer in range(self.world_size):
                if peer != self.rank:
                    windows[peer] = None

    def drop_own_windows(self, kinds: Collection[str]) -> None:
        for kind in kinds:
            self._windows(kind)[self.rank] = None
        self._remove_new_files()

    def recreate_own_windows(self, kinds: Collection[str]) -> None:
        self._generation += 1
        guard = self._new_guard = CleanupOnSignal().__enter__()
        try:
            self._new_lock = LockFile.create(self._path(self.rank, "lock"), self.rank, self.timeout_s)
            self._track(guard, self._path(self.rank, "lock"))
            for kind in kinds:
                numel, dtype = self._sizes(kind)
                path = self._path(self.rank, kind)
                self._track(guard, path)
                try:
                    create_reserved(path, numel * _itemsize(dtype))
                except SegmentSpaceError as err:
                    raise no_room(self.shm_dir, f"rank {self.job_rank}", kind, err.nbytes) from None
                self._windows(kind)[self.rank] = map_segment(path, numel, dtype)
        except BaseException:
            self.drop_own_windows(kinds)
            raise

    def _track(self, guard: CleanupOnSignal, path: str) -> None:
        self._new_files.append(path)
        guard.track([path])

    def map_peer_windows(self, kinds: Collection[str]) -> None:
        for kind in kinds:
            numel, dtype = self._sizes(kind)
            windows = self._windows(kind)
            for peer in range(self.world_size):
                if peer != self.rank:
                    windows[peer] = map_segment(self._path(peer, kind), numel, dtype)

    def windows_mapped(self, kinds: Collection[str]) -> None:
        self._remove_new_files()

    def _remove_new_files(self) -> None:
        """This rank's files of the newest generation, segments first and the lock file last."""
        for path in sorted(self._new_files, key=lambda p: p.endswith("_lock")):
            unlink_quietly(path)
        self._new_files.clear()
        if self._new_lock is not None:
            self._new_lock.close()
            self._new_lock = None
        if self._new_guard is not None:
            self._new_guard.__exit__(None, None, None)
            self._new_guard = None

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._remove_new_files()
        self._close_plane()
        self._param_windows.clear()
        self._grad_windows.clear()
        self._blocks.clear()
        for lock in self._locks:
            lock.close()  # releases this process's locks only: its life lock, on its own file
        self._locks = []


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A gradient computed on a device, pushed into host windows (``offload_param`` on a GPU): copied first."""
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()

