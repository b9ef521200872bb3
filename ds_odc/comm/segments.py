"""Shared-memory segments: files in a tmpfs directory, reserved up front, mapped as tensors, never leaked.

Lifecycle:

1. **reserve**: the owner creates its file and reserves every page with ``posix_fallocate``. A
   tmpfs that is too small (Docker's ``/dev/shm`` is 64 MB by default) fails *here*, with an error
   naming the directory, the bytes needed and free, and the fix, instead of a SIGBUS that kills
   the rank the first time it touches a page past what the tmpfs could give;
2. **map**: every rank maps every peer's file;
3. **unlink**: the owner unlinks its files as soon as every rank holds its mappings. From then on
   the memory lives exactly as long as the mappings, so no exit path (normal, exception, SIGKILL)
   can leave a file behind.

Only a crash between 1 and 3 can leave files: the transport's error path removes the whole session
on every failure it sees, :class:`CleanupOnSignal` removes a rank's own files when SIGTERM/SIGINT/
SIGHUP arrive in that window, and :func:`sweep_orphans` (run before every allocation) removes files
of ranks that died there anyway (SIGKILL): a rank is dead when its life lock is free
(:mod:`ds_odc.comm.locks`).
"""
from __future__ import annotations

import errno
import os
import re
import signal
import threading
import time
from typing import Iterable, List

import torch

from ds_odc.comm.locks import holds_life_lock

SEGMENT_PREFIX = "ds_odc_"
_NAME = re.compile(rf"^{SEGMENT_PREFIX}(?P<session>[0-9a-f]+)_r(?P<rank>\d+)_(?P<kind>[a-z]+)(?P<temp>\.creating)?$")
#: A lock file still under its temporary name this long after creation belongs to a dead rank.
TEMPORARY_GRACE_S = 60.0


class SegmentSpaceError(OSError):
    """No room for a segment: ``path`` needed ``nbytes`` more bytes than its directory had."""

    def __init__(self, path: str, nbytes: int, err: OSError):
        super().__init__(err.errno, f"cannot reserve {nbytes} bytes for {path}: {err.strerror}")
        self.path = path
        self.nbytes = nbytes


def segment_path(directory: str, session: str, rank: int, kind: str) -> str:
    """Path of one rank's segment, e.g. ``/dev/shm/ds_odc_3fa9c1_r1_params``."""
    return os.path.join(directory, f"{SEGMENT_PREFIX}{session}_r{rank}_{kind}")


def free_bytes(directory: str) -> int:
    """Bytes an unprivileged process may still allocate in ``directory``'s filesystem."""
    stats = os.statvfs(directory)
    return stats.f_bavail * stats.f_frsize


def create_reserved(path: str, nbytes: int) -> None:
    """Create ``path`` with ``nbytes`` zero bytes, every page reserved now (SegmentSpaceError if
    the filesystem cannot hold them; the partial file is removed)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 8))
        except OSError as err:
            if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG):
                raise SegmentSpaceError(path, nbytes, err) from None
            raise
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    os.close(fd)


def map_segment(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map ``numel`` elements of ``dtype`` from ``path``; writes are visible to every mapper. The file
    must exist with room for them (``torch.from_file`` would create a missing file and map zeros: a peer's
    window that is not there must be an error, never a window of zeros)."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    size = os.stat(path).st_size  # FileNotFoundError for a missing segment
    if size < nbytes:
        raise ValueError(f"segment {path} holds {size} bytes, {nbytes} expected")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def session_paths(directory: str, session: str) -> List[str]:
    """Every file of ``session`` (all ranks, all kinds, temporaries too) now in ``directory``."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [os.path.join(directory, n) for n in names
            if (m := _NAME.match(n)) is not None and m["session"] == session]


def sweep_orphans(directory: str) -> List[str]:
    """Remove the segments of ranks that died while allocating (their life lock is free, or their
    lock file is gone). Files of live ranks, and other programs' files, are left alone. Returns
    the removed paths."""
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, PermissionError):
        return []
    owners: dict = {}
    for name in names:
        match = _NAME.match(name)
        if match is not None:
            owners.setdefault((match["session"], match["rank"]), []).append((name, match))
    removed = []
    for files in owners.values():
        if not _owner_dead(directory, files):
            continue
        for name, _ in files:
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except (FileNotFoundError, PermissionError):
                pass
    return removed


def _owner_dead(directory: str, files) -> bool:
    lock = next((name for name, m in files if m["kind"] == "lock" and not m["temp"]), None)
    if lock is None:
        # the lock file is created first and removed last: without it the rank is gone, unless it
        # is still between creating its temporary lock file and renaming it
        young = [name for name, m in files if m["temp"] and _age_s(os.path.join(directory, name)) < TEMPORARY_GRACE_S]
        return not young
    try:
        fd = os.open(os.path.join(directory, lock), os.O_RDWR)
    except (FileNotFoundError, PermissionError):
        return False
    try:
        return not holds_life_lock(fd)
    finally:
        os.close(fd)


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")


class CleanupOnSignal:
    """While active, SIGTERM, SIGINT and SIGHUP first unlink the files this rank created, then do
    what they would have done (the previous handler runs, or the default action kills the process).
    A signal the process ignores (``nohup``, a background job's SIGINT) stays ignored, files kept.

    Python runs signal handlers in the main thread between bytecodes, so the cleanup runs as soon
    as the allocating code returns to Python (the allocation waits in Python, never for long in C).
    Outside the main thread signal handlers cannot be installed, and this does nothing (the start-up
    sweep remains). Usage: ``with CleanupOnSignal() as guard: ...; guard.track(path)``.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.paths: List[str] = []
        self._previous: dict = {}

    def track(self, paths: Iterable[str]) -> None:
        self.paths.extend(paths)

    def __enter__(self) -> "CleanupOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                if signal.getsignal(signum) in (None, signal.SIG_IGN):  # a C handler, or ignored: leave it
                    continue
                self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        for path in self.paths:
            unlink_quietly(path)
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._restore()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action, now that the handler is the default again
