"""One host buffer that receives the offloaded activations of the micro-batch in flight.

Why one buffer, sized by the largest single offload and not the sum: on ODC a rank runs a micro-batch's
forward and its backward before the next forward, so the offloads of two micro-batches are never alive
together. The buffer is pinned when CUDA is available (asynchronous device-to-host copies need it) and
plain host memory otherwise; it grows only while empty, to the largest reservation seen.

A micro-batch takes a :class:`Lease` (``reserve``), carves one slice per offloaded storage out of it
(``Lease.take``, back to back: a slice is only the byte destination of a copy, never viewed as its dtype,
since what comes back is copied into a fresh device allocation) and gives it back after its backward
(``Lease.release``). So the bytes in use are exactly the bytes offloaded. A lease may fill the whole buffer;
should a micro-batch save more than its plan estimated (sizes that grow faster than its token count), the
excess is spilled into host memory of its own (``PoolStats.spilled_bytes``) rather than kept on the device
against the plan, and the buffer grows to that micro-batch's size once it is released. Should a second lease
be asked for while one is alive (two forwards before a backward), it gets a buffer of its own for its
lifetime: correct, but no longer bounded by the largest offload (``PoolStats.overflow_leases`` counts them).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class PoolStats:
    """``capacity``: bytes of the pool buffer. ``high_water``: most bytes a lease held at once (spills included).
    ``spilled_bytes``: bytes that did not fit the buffer. ``overflow_leases``: leases served outside the pool
    because another was alive."""

    capacity: int = 0
    high_water: int = 0
    spilled_bytes: int = 0
    overflow_leases: int = 0


class Lease:
    """A micro-batch's slice of host memory: ``take(n)`` hands out consecutive byte slices."""

    def __init__(self, pool: "HostPool", buffer: torch.Tensor, in_pool: bool):
        self._pool, self._buffer, self._in_pool = pool, buffer, in_pool
        self.used = 0  # bytes handed out, spills included
        self._offset = 0  # end of what was carved from the buffer
        self.released = False

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host slice of ``nbytes``: the next bytes of the buffer, or a spill when it is full."""
        self.used += nbytes
        if self._in_pool:
            self._pool.stats.high_water = max(self._pool.stats.high_water, self.used)
        if self._offset + nbytes <= self._buffer.numel():
            self._offset += nbytes
            return self._buffer[self._offset - nbytes:self._offset]
        self._pool.stats.spilled_bytes += nbytes
        return self._pool._allocate(nbytes)

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
            return Lease(self, self._allocate(need), in_pool=False)
        self._grow(need)
        self._lease = Lease(self, self._buffer, in_pool=True)
        return self._lease

    def _grow(self, nbytes: int) -> None:
        if nbytes > self._buffer.numel():
            self._buffer = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self._buffer = self._allocate(nbytes)
            self.stats.capacity = nbytes

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def _returned(self, lease: Lease) -> None:
        if lease is self._lease:
            self._lease = None
            self._grow(lease.used)  # a micro-batch that spilled: the next one that size fits
