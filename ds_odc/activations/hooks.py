"""Saved-tensor hooks of one micro-batch: the planned tensors go to the host pool in forward and come back
in reverse order ahead of their use in backward.

[Note: what is never offloaded] Parameters, and any tensor sharing storage with a parameter's data (ZeRO-3's
gathered full parameter, or a view of it such as the ``weight.t()`` a linear layer saves) or with its shard
(``ds_tensor``): the parameter is pulled again for backward anyway, and copying it would move nearly the
whole model every micro-batch (what a naive ``save_on_cpu`` does). The caller supplies the test
(``is_parameter``), since only the adapter knows where ZeRO-3 keeps parameters.

[Note: one copy per storage] Tensors are copied as whole storages: a second saved view of a storage already
offloaded in this micro-batch (``x`` and ``x.t()``) gets the same host copy, so a storage crosses once each
way. A storage is recognised by its address while it is alive (``StorageWeakRef``): an address freed and
reused later in the forward is a new storage.

On CUDA the device-to-host copies run on a copy stream (the source storage is recorded on that stream so
the allocator does not reuse it early) and the host-to-device ones on a prefetch stream, ``PREFETCH``
storages ahead of the one backward asks for, newest first. On CPU both are synchronous copies into and out
of the separate host pool: the bytes really travel, so pack and unpack run as they would on a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ds_odc.activations.policy import OffloadDecision
from ds_odc.activations.pool import Lease

#: Storages brought back ahead of the one backward is unpacking.
PREFETCH = 2


@dataclasses.dataclass
class MicroBatchStats:
    """What one micro-batch's hooks did. ``planned_*``: the decision; ``moved_*``: storages copied to the host
    (each once); ``deduplicated``: saves that reused a copy; ``parameter_saves``: saves left alone because
    they are parameters (see [Note: what is never offloaded]); ``kept_bytes``: activation storages left on the
    device; ``returned_bytes``: bytes copied back."""

    tokens: int
    planned_tensors: int
    planned_bytes: int
    moved_tensors: int = 0
    moved_bytes: int = 0
    deduplicated: int = 0
    parameter_saves: int = 0
    kept_bytes: int = 0
    returned_bytes: int = 0


@dataclasses.dataclass
class _Stored:
    """One offloaded storage: its host slice and, once brought back, its device copy."""

    index: int
    host: torch.Tensor
    device: torch.device
    alive: StorageWeakRef
    uses: int = 0
    on_device: Optional[torch.Tensor] = None
    ready: Optional[torch.cuda.Event] = None


@dataclasses.dataclass(frozen=True)
class _Packed:
    """What autograd keeps instead of an offloaded tensor: its storage's record and how to view it."""

    stored: _Stored
    dtype: torch.dtype
    size: torch.Size
    stride: tuple
    offset: int


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (what is copied)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class MicroBatchOffload:
    """The hooks of one micro-batch (see the module docstring). ``eligible(t)``: the mode's test (every
    saved activation, or only checkpoint inputs); ``streams``: (copy, prefetch) CUDA streams, or None."""

    def __init__(self, decision: OffloadDecision, lease: Lease, device: torch.device,
                 is_parameter: Callable[[torch.Tensor], bool], eligible: Callable[[torch.Tensor], bool],
                 streams: Optional[tuple] = None):
        self.decision, self._lease, self._device = decision, lease, torch.device(device)
        self._is_parameter, self._eligible, self._streams = is_parameter, eligible, streams
        self._stored: list[_Stored] = []
        self._by_address: dict[int, _Stored] = {}
        self._seen: dict[tuple, StorageWeakRef] = {}
        self.stats = MicroBatchStats(decision.tokens, decision.tensors, decision.offload_bytes)
        self.observed: list[int] = []  # bytes of each offloadable storage saved, in order (a fresh profile)
        self.observed_kept = 0  # bytes of the storages the mode excludes

    def hooks(self):
        """The ``saved_tensors_hooks`` context for the micro-batch's forward."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -- forward: pack ---------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor):
        if tensor.device != self._device or tensor.layout != torch.strided:
            return tensor
        if self._is_parameter(tensor):
            self.stats.parameter_saves += 1
            return tensor
        storage, offloadable = tensor.untyped_storage(), self._eligible(tensor)
        if self._seen_before(storage, offloadable):
            stored = self._by_address.get(storage.data_ptr()) if offloadable else None
            if stored is None:  # excluded, or past the planned count: it stays, and was counted
                return tensor
            self.stats.deduplicated += 1
        elif not offloadable:
            return tensor
        else:
            stored = self._offload(storage)
            if stored is None:
                self.stats.kept_bytes += storage.nbytes()
                return tensor
        stored.uses += 1
        return _Packed(stored, tensor.dtype, tensor.size(), tensor.stride(), int(tensor.storage_offset()))

    def _seen_before(self, storage, offloadable: bool) -> bool:
        """Whether this live storage was saved before in this micro-batch (in the same category); a new one is
        recorded in ``observed`` (or ``observed_kept``) and any record of a dead storage at its address dropped."""
        key = (offloadable, storage.data_ptr())
        known = self._seen.get(key)
        if known is not None and not known.expired():
            return True
        self._seen[key] = StorageWeakRef(storage)
        if offloadable:
            self._by_address.pop(storage.data_ptr(), None)
            self.observed.append(storage.nbytes())
        else:
            self.observed_kept += storage.nbytes()
        return False

    def _offload(self, storage) -> Optional[_Stored]:
        nbytes = storage.nbytes()
        if nbytes == 0 or self.stats.moved_tensors >= self.decision.tensors:
            return None
        host = self._lease.take(nbytes)
        source = _bytes_of(storage)
        if self._streams is None:
            host.copy_(source)
        else:
            copy_stream = self._streams[0]
            copy_stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(copy_stream):
                host.copy_(source, non_blocking=True)
            source.record_stream(copy_stream)  # the allocator keeps the storage until the copy is done
        stored = _Stored(len(self._stored), host, storage.device, StorageWeakRef(storage))
        self._stored.append(stored)
        self._by_address[storage.data_ptr()] = stored
        self.stats.moved_tensors += 1
        self.stats.moved_bytes += nbytes
        return stored

    # -- backward: unpack, prefetching newest first ----------------------------------------------------------
    def prefetch(self, below: Optional[int] = None) -> None:
        """Start bringing back up to PREFETCH storages saved before index ``below`` (the newest ones: what
        backward needs first); ``below=None``: the newest of all (ahead of backward)."""
        start = len(self._stored) if below is None else below
        for stored in self._stored[max(0, start - PREFETCH):start][::-1]:
            if stored.on_device is None:
                self._bring_back(stored)

    def _bring_back(self, stored: _Stored) -> None:
        on_device = torch.empty(stored.host.numel(), dtype=torch.uint8, device=stored.device)
        if self._streams is None:
            on_device.copy_(stored.host)
        else:
            prefetch_stream = self._streams[1]
            if self._streams[0] is not None:
                prefetch_stream.wait_stream(self._streams[0])  # the offload copy has landed
            with torch.cuda.stream(prefetch_stream):
                on_device.copy_(stored.host, non_blocking=True)
                stored.ready = torch.cuda.Event()
                stored.ready.record(prefetch_stream)
            on_device.record_stream(prefetch_stream)
        stored.on_device = on_device
        self.stats.returned_bytes += stored.host.numel()

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        stored = packed.stored
        if stored.on_device is None:
            self._bring_back(stored)
        self.prefetch(below=stored.index)
        if stored.ready is not None:
            torch.cuda.current_stream(stored.device).wait_event(stored.ready)
        view = torch.empty(0, dtype=packed.dtype, device=stored.device).set_(
            stored.on_device.untyped_storage(), packed.offset, packed.size, packed.stride)
        stored.uses -= 1
        if stored.uses <= 0:  # every saved view of it unpacked: autograd holds what it still needs
            stored.on_device, stored.ready = None, None
        return view

    def finish(self) -> None:
        """After the micro-batch's backward: the host slices go back to the pool."""
        self._by_address.clear()
        self._seen.clear()
        if self._streams is not None:  # the next micro-batch's copies into these slices wait for every read
            self._streams[0].wait_stream(self._streams[1])  # of them (a prefetch backward never unpacked too)
        self._lease.release()


@contextlib.contextmanager
def counting_hooks(device: torch.device, is_parameter: Callable[[torch.Tensor], bool],
                   eligible: Callable[[torch.Tensor], bool], sizes: list, kept: list):
    """Hooks that move nothing: each new storage's bytes go to ``sizes`` when ``eligible``, to ``kept``
    otherwise (parameters to neither), in save order, views of a storage once (calibration)."""
    seen: dict[tuple, StorageWeakRef] = {}
    device = torch.device(device)

    def pack(tensor):
        if tensor.device != device or tensor.layout != torch.strided or is_parameter(tensor):
            return tensor
        storage, offloadable = tensor.untyped_storage(), eligible(tensor)
        key = (offloadable, storage.data_ptr())  # as MicroBatchOffload: eligible saves share copies among themselves
        known = seen.get(key)
        if known is None or known.expired():
            seen[key] = StorageWeakRef(storage)
            (sizes if offloadable else kept).append(storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
