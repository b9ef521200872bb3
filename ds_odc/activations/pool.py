"""One host buffer that receives the offloaded activations of the micro-batch in flight.

Why one buffer, sized by the largest single offload and not the sum: on ODC a rank runs a micro-batch's
forward and its backward before the next forward, so the offloads of two micro-batches are never alive
together. The buffer is pinned when CUDA is available (asynchronous device-to-host copies need it) and
plain host memory otherwise; it grows only while empty, to the largest reservation seen.

A micro-batch takes a :class:`Lease` (``reserve``), carves one slice per offloaded storage out of it
(``Lease.take``, back to back: a slice is only the byte destination of a copy, never viewed as its dtype,
since what comes back is copied into a fresh device allocation) and gives it back after its backward
(``Lease.release``). So the bytes in use are exactly the bytes offloaded. Should a second lease be asked for while one is alive (two forwards before a backward),
it gets a buffer of its own for its lifetime: correct, but no longer bounded by the largest offload
(``PoolStats.overflow_leases`` counts them).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

@dataclasses.dataclass
class PoolStats:
    """``capacity``: bytes of the pool buffer. ``high_water``: most bytes in use at once. ``overflow_leases``:
    leases served outside the pool because another was alive."""

    capacity: int = 0
    high_water: int = 0
    overflow_leases: int = 0


class Lease:
    """A micro-batch's slice of host memory: ``take(n)`` hands out consecutive byte slices."""

    def __init__(self, pool: "HostPool", buffer: torch.Tensor, size: int, in_pool: bool):
        self._pool, self._buffer, self._in_pool = pool, buffer, in_pool
        self.size = size
        self.used = 0
        self.released = False

    def take(self, nbytes: int) -> Optional[torch.Tensor]:
        """A uint8 host slice of ``nbytes``, or None when the lease has no room left (the caller keeps the
        tensor on the device: a plan made from a stale profile never overruns the pool)."""
        start = self.used
        if start + nbytes > self.size:
            return None
        self.used = start + nbytes
        if self._in_pool:
            self._pool.stats.high_water = max(self._pool.stats.high_water, self.used)
        return self._buffer[start:start + nbytes]

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._pool._returned(self)


class HostPool:
    """See the module docstring."""

    def __init__(self, pin: Optional[bool] = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._lease: Optional[Lease] = None
        self.stats = PoolStats()

    def reserve(self, nbytes: int) -> Lease:
        """A lease of ``nbytes``."""
        need = nbytes
        if self._lease is not None and not self._lease.released:
            self.stats.overflow_leases += 1
            return Lease(self, self._allocate(need), need, in_pool=False)
        if need > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self._buffer = self._allocate(need)
            self.stats.capacity = need
        self._lease = Lease(self, self._buffer, need, in_pool=True)
        return self._lease

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def _returned(self, lease: Lease) -> None:
        if lease is self._lease:
            self._lease = None
