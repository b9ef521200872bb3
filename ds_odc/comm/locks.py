"""Each rank's lock file: its liveness, and the stripe locks of its gradient accumulator.

Both are POSIX record locks, which the kernel releases when their holder dies, however it dies:

* **life lock** (byte :data:`LIFE_BYTE`): the rank holds it exclusively from before anyone can
  open the file (the file is created under a temporary name, locked, then renamed) until it closes
  its transport or exits. A peer tests it with a non-blocking shared lock: if it can take the lock,
  the rank is gone. Unlike a pid, this means the same thing in every pid namespace sharing the
  directory, cannot be fooled by pid reuse, and is never read as "exited" before the rank started;
* **stripe locks** (byte ``i`` guards stripe ``i``): pushers into this rank's accumulator take the
  stripe's lock around their add, so concurrent adds into one stripe serialise and adds into
  different stripes run in parallel; a pusher killed mid-add never wedges the others.

POSIX record locks belong to a (process, file) pair, and closing *any* descriptor of the file
releases all of the process's locks on it. So each process opens each lock file exactly once and
keeps that descriptor for the transport's lifetime; threads of one process that push (the training thread,
and with ``cross_node: "global"`` the thread serving pushes from other nodes) exclude each other with a lock of
the transport's own (``ShmTransport.push_guard``).
"""
from __future__ import annotations

import errno
import fcntl
import os

from ds_odc.comm.backoff import wait_until
from ds_odc.errors import ODCTimeoutError

#: Byte whose lock means "this rank is alive"; stripes use bytes 0, 1, 2, ... well below it.
LIFE_BYTE = 1 << 40


class LockFile:
    """One rank's lock file, opened once by one process (its owner or a peer)."""

    def __init__(self, fd: int, owner: int, timeout_s: float):
        self.owner = owner
        self.timeout_s = timeout_s
        self._fd = fd

    @classmethod
    def create(cls, path: str, owner: int, timeout_s: float) -> "LockFile":
        """Create ``path`` with this process holding its life lock before the file is visible."""
        temporary = f"{path}.creating"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, LIFE_BYTE)
            os.rename(temporary, path)
        except BaseException:
            os.close(fd)
            _unlink_quietly(temporary)
            raise
        return cls(fd, owner, timeout_s)

    @classmethod
    def open(cls, path: str, owner: int, timeout_s: float) -> "LockFile":
        return cls(os.open(path, os.O_RDWR), owner, timeout_s)

    # -- liveness ----------------------------------------------------------------------------------
    def owner_alive(self) -> bool:
        """True while the owner holds its life lock (never ask this of your own lock file)."""
        return holds_life_lock(self._fd)

    # -- stripes -----------------------------------------------------------------------------------
    def _try(self, stripe: int) -> bool:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, stripe)
            return True
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return False

    def acquire(self, stripe: int) -> None:
        """Take stripe ``stripe`` exclusively; raise ODCTimeoutError after ``timeout_s``."""
        if self._try(stripe):
            return
        if not wait_until(lambda: self._try(stripe), self.timeout_s, first_s=20e-6):
            raise ODCTimeoutError(
                f"push to rank {self.owner}: accumulator stripe {stripe} stayed locked for more than "
                f"{self.timeout_s:.0f}s (a peer holding it is stopped or stuck)")

    def release(self, stripe: int) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)

    def close(self) -> None:
        """Release every lock this process holds on the file (the owner's life lock included)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def holds_life_lock(fd: int) -> bool:
    """Whether some other process holds the life lock of the lock file open as ``fd``."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, LIFE_BYTE)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return True
        raise
    fcntl.lockf(fd, fcntl.LOCK_UN, 1, LIFE_BYTE)
    return False


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
