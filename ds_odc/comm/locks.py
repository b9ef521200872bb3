"""Striped, crash-safe locks guarding concurrent adds into one owner's accumulator.

Each owner has a lock file; stripe ``i`` of its accumulator is guarded by a POSIX record lock on
byte ``i`` of that file. The kernel releases a process's record locks when it dies, so a pusher
killed mid-add never wedges the owner or the other pushers. Several pushers add into *different*
stripes of the same owner concurrently; only same-stripe adds serialise.

POSIX record locks belong to the process, so a single thread per process must do the pushes
(the backward thread does) and the file must stay open for the transport's lifetime.
"""
from __future__ import annotations

import errno
import fcntl
import os
import time

from ds_odc.errors import ODCTimeoutError


class StripeLocks:
    """The lock file of one owner, opened by one pusher."""

    def __init__(self, path: str, owner: int, timeout_s: float):
        self.owner = owner
        self.timeout_s = timeout_s
        self._fd = os.open(path, os.O_RDWR)

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
        deadline = time.monotonic() + self.timeout_s
        pause = 20e-6
        while not self._try(stripe):
            if time.monotonic() > deadline:
                raise ODCTimeoutError(
                    f"push to rank {self.owner}: accumulator stripe {stripe} stayed locked for more than "
                    f"{self.timeout_s:.0f}s (a peer holding it is stopped or stuck)")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def release(self, stripe: int) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, stripe)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
