"""The ``cuda_ipc`` transport: one-sided windows in GPU memory, for the ranks of one node.

Per rank, created once in :meth:`CudaIpcTransport.allocate`: a parameter window (compute dtype)
and a gradient accumulator (fp32 or fp64), each one ``cudaMalloc`` whose IPC handles travel in the
rank's control block; every rank maps every peer's windows. The control plane (lock file, control
block, typed rounds, liveness, the failure record) is the ``shm`` transport's, allocated by the same
:class:`~ds_odc.comm.allocation.NodeAllocation` protocol: a fence is a handful of stores in host
shared memory, and dead, failed or stuck peers are detected there exactly as on CPU.

* **pull** = ``out.copy_(peer_window[offset:offset+n])`` on a dedicated pull stream, which first
  waits for the caller's stream (``out`` is ready) and which the caller's stream then waits for
  (``out`` is filled). A copy between device memory and a peer mapping is a DMA by the copy
  engines: no SM is taken from compute. ZeRO-3's prefetch issues it early, so it overlaps compute.
* **push** = one kernel (``ops/csrc/odc_kernels.cu``) on the caller's stream that adds the
  gradient slice (bf16/fp16/fp32, converted in registers) into the owner's accumulator through the
  mapping with system-scope atomic reductions: no staging buffer, no daemon, no host polling, no
  acknowledgement, and the host returns at once. The caller picks the stream: the ODC optimizer
  pushes on ZeRO-3's reduce side stream (where its reduce-scatter ran), so pushes overlap the rest
  of backward, while ZeRO-3's own stream ordering keeps its gradient bucket from being refilled
  before the kernel has read it. The gradient's memory is kept from reuse by the allocator until
  then too (``record_stream``).
* **batched** (``read_many`` / ``accumulate_many``): the same copies and kernels, issued together,
  with a handle whose ``wait()`` orders the caller's stream after them (one event, no host block).
* **step** = every :meth:`exchange` first synchronises this rank's device (all its pulls and
  pushes complete, its own writes to its windows done), then runs the host rendezvous. After the
  fence round every push of every rank has completed, so each owner's accumulator holds the sum.

Memory per rank: its two windows; peers' windows are mappings, not copies; no staging at all.

Windows away and back (``engine.offload_states``, :class:`~ds_odc.comm.transport.Transport`): a rank frees
its own window only after a round in which every peer closed its mapping of it (freeing exported memory that
another process maps is undefined in CUDA), so the memory returns to the device for a rollout engine; windows
made again are new ``cudaMalloc`` allocations whose handles replace the old ones in the control block's blob,
opened by every peer after the next round.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Collection, List, Optional, Sequence

import torch
import torch.distributed as tdist

from ds_odc.comm.allocation import NodeAllocation, format_bytes
from ds_odc.comm.backoff import wait_until
from ds_odc.comm.batch import Completion, Transfer
from ds_odc.comm.control import W_UNMAPPED
from ds_odc.comm.gpu_topology import RankDevice, resolve_peer_devices
from ds_odc.comm.push_plan import DEFAULT_MAX_BLOCKS, DEFAULT_THREADS, push_plan
from ds_odc.comm.transport import Transport, WindowSpec
from ds_odc.comm.wording import NUMBERS, Wording
from ds_odc.errors import ODCConfigError, ODCStateError

#: Gradient dtypes the push kernel reads directly; others are converted to fp32 first.
PUSHABLE = (torch.float32, torch.bfloat16, torch.float16)
#: Longest a closing rank waits for live peers to unmap its windows before it frees them.
CLOSE_WAIT_S = 10.0
#: Windows a live peer may still map when their owner closed: kept until process exit rather than
#: freed under the peer (freeing exported memory that another process maps is undefined in CUDA).
_KEPT_FOR_PEERS: list = []
HANDLE_BYTES = 64


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcTransport(Transport):
    name = "cuda_ipc"
    supports_residency = True

    def __init__(self, rank: int, world_size: int, timeout_s: float, device: torch.device | str | int,
                 shm_dir: str = "/dev/shm", group=None, push_threads: int = DEFAULT_THREADS,
                 push_max_blocks: Optional[int] = DEFAULT_MAX_BLOCKS, first_rank: int = 0, wording: Wording = NUMBERS):
        super().__init__(rank, world_size, timeout_s, first_rank, wording)
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaIpcTransport needs a CUDA device, got {device}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        self.shm_dir = shm_dir
        self.group = group
        self.push_threads = push_threads
        self.push_max_blocks = push_max_blocks
        self._ops: Any = None  # the compiled operator (untyped), loaded (built on first use) by allocate()
        self._param_windows: list = []
        self._grad_windows: list = []
        self._blocks: list = []
        self._locks: list = []
        self._own: dict = {}  # kind -> this rank's own allocation ("params", "grads")
        self._handles: dict = {}  # kind -> its IPC handle, as the blob carries it
        self._exported = False  # our IPC handles are in our control block: peers may have mapped our windows
        self._pull_stream: Optional[torch.cuda.Stream] = None  # made by allocate(): see _pulls
        self._closed = False

    # -- allocation (collective, once) ---------------------------------------------------------
    def allocate(self, spec: WindowSpec) -> None:
        from ds_odc.ops_builder import CUDA_IPC, load_op

        self._ops = load_op(CUDA_IPC)  # JIT-built with ninja on first use, cached afterwards
        index = self.device.index
        me = RankDevice(socket.gethostname(), os.getpid(), device_uuid(index))
        devices: List[Any] = [None] * self.world_size  # every rank's RankDevice, once gathered
        tdist.all_gather_object(devices, me, group=self.group)
        local_uuids = [device_uuid(i) for i in range(torch.cuda.device_count())]
        resolve_peer_devices(devices, self.rank, local_uuids, self._ops.p2p_attributes)
        allocation = NodeAllocation(self.rank, self.world_size, self.shm_dir, spec.exchange_width, {}, self.group,
                                    self.first_rank)
        allocation.allocate(create=lambda: self._create_windows(allocation, spec),
                            map_peers=lambda: self._map_every_rank(allocation, spec),
                            release=self._release_after_failure,
                            creating=f"allocating its GPU windows on {self.device}",
                            mapping="mapping its peers' GPU windows")
        self._pull_stream = torch.cuda.Stream(device=self.device)
        self._start_plane(self._blocks, lambda r: self._locks[r].owner_alive(),
                          lambda r: f"{allocation.name(r)} (pid {allocation.infos[r].pid}, {devices[r].uuid})",
                          spec.exchange_width)

    def _create_windows(self, allocation: NodeAllocation, spec: WindowSpec) -> None:
        block = allocation.create_own_files(self.timeout_s)
        param_bytes, grad_bytes = _nbytes(spec)
        try:
            own_params, params_handle = self._ops.alloc_window(param_bytes, self.device.index)
            own_grads, grads_handle = self._ops.alloc_window(grad_bytes, self.device.index)
        except RuntimeError as err:
            free, total = torch.cuda.mem_get_info(self.device)
            raise ODCConfigError(
                f"{self.device}: cannot allocate rank {self.rank}'s GPU windows ({format_bytes(param_bytes)} "
                f"parameters + {format_bytes(grad_bytes)} gradient accumulator; {format_bytes(free)} of "
                f"{format_bytes(total)} free): {err}. Free GPU memory, use more GPUs, or a smaller model") from None
        self._own = {"params": own_params, "grads": own_grads}
        self._handles = {"params": bytes(params_handle), "grads": bytes(grads_handle)}
        self._exported = True
        self._spec = spec
        block.write_blob(self._handles["params"] + self._handles["grads"])

    def _map_every_rank(self, allocation: NodeAllocation, spec: WindowSpec) -> None:
        allocation.open_peer_locks(self.timeout_s)
        self._locks = allocation.peer_locks
        self._blocks = [allocation.map_control(r) for r in range(self.world_size)]
        for peer in range(self.world_size):
            self._param_windows.append(self._window(peer, "params"))
            self._grad_windows.append(self._window(peer, "grads"))

    def _window(self, peer: int, kind: str) -> torch.Tensor:
        """Our own window of ``kind``, or our mapping of ``peer``'s, from the handle in its blob."""
        spec = self.spec
        dtype = spec.param_dtype if kind == "params" else spec.grad_dtype
        if peer == self.rank:
            return self._own[kind].view(dtype)
        handles = self._blocks[peer].read_blob()
        start = 0 if kind == "params" else HANDLE_BYTES
        nbytes = _nbytes(spec)[0 if kind == "params" else 1]
        return self._ops.open_window(handles[start:start + HANDLE_BYTES], nbytes, self.device.index).view(dtype)

    def _release_after_failure(self) -> None:
        """The allocation failed: drop our mappings of peers; our own windows may be mapped by a live
        peer that saw our handles, so they are kept until exit, never freed under it."""
        self._param_windows.clear()
        self._grad_windows.clear()
        self._blocks.clear()
        if self._own and self._exported:
            _KEPT_FOR_PEERS.append(self._own)
        self._own = {}
        self._closed = True

    # -- one-sided access ------------------------------------------------------------------------
    @property
    def _pulls(self) -> torch.cuda.Stream:
        """The stream pulls copy on, made by :meth:`allocate`."""
        if self._pull_stream is None:
            raise ODCStateError(f"the cuda_ipc transport of rank {self.job_rank} has no pull stream: allocate() has "
                                "not run")
        return self._pull_stream

    def local_param_window(self) -> torch.Tensor:
        return self._param_windows[self.rank]

    def local_grad_accumulator(self) -> torch.Tensor:
        return self._grad_windows[self.rank]

    def _check_device(self, tensor: torch.Tensor, what: str) -> None:
        if tensor.device != self.device:
            raise ValueError(f"cuda_ipc transport of rank {self.rank} lives on {self.device}; {what} is on "
                             f"{tensor.device}")

    def read(self, owner: int, offset: int, out: torch.Tensor) -> None:
        self._check_device(out, "the pull destination")
        source = self._param_windows[owner].narrow(0, offset, out.numel())
        current, pulls = torch.cuda.current_stream(self.device), self._pulls
        pulls.wait_stream(current)
        with torch.cuda.stream(pulls):
            out.copy_(source.view(out.shape))
        current.wait_stream(pulls)

    def accumulate(self, owner: int, offset: int, grad: torch.Tensor) -> None:
        self._check_device(grad, "the gradient")
        grad = grad.reshape(-1)
        if grad.dtype not in PUSHABLE:
            grad = grad.float()
        grad = grad.contiguous()
        if grad.numel() == 0:
            return
        target = self._grad_windows[owner].narrow(0, offset, grad.numel())
        plan = push_plan(target.data_ptr(), grad.data_ptr(), grad.numel(), target.element_size(),
                         grad.element_size(), threads=self.push_threads, max_blocks=self.push_max_blocks)
        with torch.cuda.device(self.device):  # the op launches on the current stream of this device
            self._ops.scatter_add(target, grad, plan.head, plan.groups, plan.vector_loads, plan.blocks, plan.threads)
        grad.record_stream(torch.cuda.current_stream(self.device))  # not reused before the kernel read it

    def read_many(self, reads: Sequence[Transfer]) -> Completion:
        """Every copy back to back on the pull stream (which first waits for the caller's stream), and
        one event after the last: the handle's ``wait()`` makes the caller's current stream wait for it,
        so the host never blocks and a prefetch overlaps compute until the module needs its parameters.
        Today that is one ``cudaMemcpyAsync`` per owner per parameter (copy engines, no SM); the intent
        is one launch per module (a batched memcpy, ``cudaMemcpyBatchAsync`` on CUDA >= 12.8, or a
        multi-range copy kernel), to be measured against this on a GPU (docs/gpu.md)."""
        current, pulls = torch.cuda.current_stream(self.device), self._pulls
        pulls.wait_stream(current)
        with torch.cuda.stream(pulls):
            for transfer in reads:
                out = transfer.tensor
                self._check_device(out, "the pull destination")
                out.copy_(self._param_windows[transfer.owner].narrow(0, transfer.offset, out.numel()).view(out.shape))
                out.record_stream(pulls)  # allocated on the caller's stream, written on ours
            done = torch.cuda.Event()
            done.record(pulls)
        return _StreamCompletion(done, self.device)

    def accumulate_many(self, pushes: Sequence[Transfer]) -> Completion:
        """Every push on the caller's stream, as :meth:`accumulate`, and one event after the last.
        Today one ``scatter_add`` launch per owner per parameter; the intent is one launch per module
        (the kernel taking a device array of (destination, source, count) ranges), owed with its GPU
        validation (docs/gpu.md)."""
        for transfer in pushes:
            self.accumulate(transfer.owner, transfer.offset, transfer.tensor)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        return _StreamCompletion(done, self.device)

    def exchange(self, kind: int, step: int, values: torch.Tensor, what: str = "") -> torch.Tensor:
        torch.cuda.synchronize(self.device)  # this rank's pushes, pulls and window writes have completed
        return super().exchange(kind, step, values, what)

    # -- windows away and back (see Transport) --------------------------------------------------------
    def _windows(self, kind: str) -> list:
        return {"params": self._param_windows, "grads": self._grad_windows}[kind]

    def drop_peer_windows(self, kinds: Collection[str]) -> None:
        torch.cuda.synchronize(self.device)  # no copy from, nor push into, a peer's window is still running
        for kind in kinds:
            windows = self._windows(kind)
            for peer in range(self.world_size):
                if peer != self.rank:
                    windows[peer] = None  # closes the IPC mapping (cudaIpcCloseMemHandle)

    def drop_own_windows(self, kinds: Collection[str]) -> None:
        torch.cuda.synchronize(self.device)  # our copies out of them have completed
        for kind in kinds:
            self._windows(kind)[self.rank] = None
            self._own.pop(kind, None)  # cudaFree once the caller's views are gone too

    def recreate_own_windows(self, kinds: Collection[str]) -> None:
        made = {}
        spec = self.spec
        try:
            for kind in kinds:
                nbytes = _nbytes(spec)[0 if kind == "params" else 1]
                try:
                    made[kind], handle = self._ops.alloc_window(nbytes, self.device.index)
                except RuntimeError as err:
                    free, total = torch.cuda.mem_get_info(self.device)
                    raise ODCConfigError(
                        f"{self.device}: cannot allocate rank {self.job_rank}'s {kind} window again "
                        f"({format_bytes(nbytes)}; {format_bytes(free)} of {format_bytes(total)} free): {err}. "
                        "Release the memory another engine holds (a rollout engine's sleep mode, "
                        "torch.cuda.empty_cache()) and call engine.reload_states() again") from None
                self._handles[kind] = bytes(handle)
        except BaseException:
            made.clear()  # never exported: freed at once
            raise
        self._own.update(made)
        for kind in kinds:
            self._windows(kind)[self.rank] = self._own[kind].view(
                spec.param_dtype if kind == "params" else spec.grad_dtype)
        self._blocks[self.rank].write_blob(self._handles["params"] + self._handles["grads"])

    def map_peer_windows(self, kinds: Collection[str]) -> None:
        for kind in kinds:
            windows = self._windows(kind)
            for peer in range(self.world_size):
                if peer != self.rank:
                    windows[peer] = self._window(peer, kind)

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._own:
            try:
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - a faulted context cannot be synchronised; release anyway
                pass
        self._param_windows.clear()  # drops the peer mappings (cudaIpcCloseMemHandle)
        self._grad_windows.clear()
        if self._own and not self._peers_unmapped():
            _KEPT_FOR_PEERS.append(self._own)
        self._own = {}
        self._close_plane()
        self._blocks.clear()
        for lock in self._locks:
            lock.close()
        self._locks = []

    def _peers_unmapped(self) -> bool:
        """Say we dropped our mappings of peers; wait (bounded) until every peer that is alive has
        dropped its mappings of ours, so that freeing our windows is safe. Liveness is the peers'
        life lock, so a peer that has not exited is never taken for dead."""
        plane = self.plane
        if plane is None:
            return False
        me = plane.me
        me.ordering.store_release(me.words, W_UNMAPPED, 1)

        def every_live_peer_unmapped() -> bool:
            return all(plane.blocks[r].ordering.load_acquire(plane.blocks[r].words, W_UNMAPPED) == 1
                       or not plane.alive(r) for r in plane.peers())

        return wait_until(every_live_peer_unmapped, min(self.timeout_s, CLOSE_WAIT_S), first_s=1e-3)


class _StreamCompletion(Completion):
    """A batched transfer queued on a CUDA stream: ``wait()`` orders the caller's current stream after
    it (no host block), as ``torch.distributed``'s ``Work.wait()`` does for NCCL."""

    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self._event = event
        self._device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()


def _nbytes(spec: WindowSpec) -> tuple:
    return spec.param_numel * _itemsize(spec.param_dtype), spec.grad_numel * _itemsize(spec.grad_dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
