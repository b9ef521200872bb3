"""An in-process transport for unit tests of the step protocol: ranks are threads of one process.

Windows and control blocks are plain tensors shared by the threads, but the control plane is the
real one (control blocks, typed rounds, failure records, activity), so the protocol logic under
test is exactly what the shm and cuda_ipc transports run. Liveness is a flag the test flips.
"""
from __future__ import annotations

import threading
from typing import Callable, List

import torch

from ds_odc.comm.control import ControlBlock, State, block_words
from ds_odc.comm.ordering import memory_ordering
from ds_odc.comm.transport import Transport, WindowSpec
from ds_odc.runtime import MicroBatchLedger, ODCRuntime, StepUpdate, WindowLayout
from ds_odc.runtime.round_kinds import PROTOCOL_WORDING


class LoopbackGroup:
    """``world`` ranks' windows and control blocks in this process's memory."""

    def __init__(self, world: int, param_numel: int = 16, grad_numel: int = 16, width: int = 8,
                 timeout_s: float = 2.0, grad_dtype: torch.dtype = torch.float32):
        self.world = world
        self.spec = WindowSpec(param_numel, torch.float32, grad_numel, width, grad_dtype)
        self.timeout_s = timeout_s
        ordering = memory_ordering()
        self.blocks = [ControlBlock(torch.zeros(block_words(width), dtype=torch.int64), width, ordering)
                       for _ in range(world)]
        for block in self.blocks:
            block.init(pid=0)
            block.set_state(State.RUNNING)
        self.params = [torch.zeros(param_numel) for _ in range(world)]
        self.grads = [torch.zeros(grad_numel, dtype=grad_dtype) for _ in range(world)]
        self.alive = [True] * world
        self.refuse_recreate = [False] * world  # a rank whose next recreate_own_windows fails (once)
        self.lock = threading.Lock()

    def transport(self, rank: int) -> "LoopbackTransport":
        transport = LoopbackTransport(self, rank)
        transport.allocate(self.spec)
        return transport

    def run(self, fn: Callable[[int, "LoopbackTransport"], object], timeout: float = 30.0) -> List[tuple]:
        """Run ``fn(rank, transport)`` on every rank in its own thread; ``[(ok, value_or_exception)]``."""
        results: List[tuple] = [(False, TimeoutError("did not finish"))] * self.world
        transports = [self.transport(r) for r in range(self.world)]

        def body(rank):
            try:
                results[rank] = (True, fn(rank, transports[rank]))
            except BaseException as err:  # noqa: BLE001 - returned to the test
                results[rank] = (False, err)

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout)
        return results


class LoopbackTransport(Transport):
    name = "loopback"
    supports_residency = True

    def __init__(self, group: LoopbackGroup, rank: int):
        super().__init__(rank, group.world, group.timeout_s, wording=PROTOCOL_WORDING)
        self.group = group

    def allocate(self, spec: WindowSpec) -> None:
        self._start_plane(self.group.blocks, lambda r: self.group.alive[r], None, spec.exchange_width)

    def local_param_window(self) -> torch.Tensor:
        return self.group.params[self.rank]

    def local_grad_accumulator(self) -> torch.Tensor:
        return self.group.grads[self.rank]

    def read(self, owner: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(self.group.params[owner].narrow(0, offset, out.numel()))

    def accumulate(self, owner: int, offset: int, grad: torch.Tensor) -> None:
        with self.group.lock:
            self.group.grads[owner].narrow(0, offset, grad.numel()).add_(grad.reshape(-1))

    # windows away and back: the group's list entry is the window (None while away)
    def _windows(self, kind):
        return self.group.params if kind == "params" else self.group.grads

    def drop_peer_windows(self, kinds) -> None:
        pass  # one process: there are no mappings of peers' windows

    def drop_own_windows(self, kinds) -> None:
        for kind in kinds:
            self._windows(kind)[self.rank] = None

    def recreate_own_windows(self, kinds) -> None:
        if self.group.refuse_recreate[self.rank]:
            self.group.refuse_recreate[self.rank] = False
            raise MemoryError(f"loopback rank {self.rank}: no room (injected)")
        for kind in kinds:
            numel = self.group.spec.param_numel if kind == "params" else self.group.spec.grad_numel
            dtype = self.group.spec.param_dtype if kind == "params" else self.group.spec.grad_dtype
            self._windows(kind)[self.rank] = torch.zeros(numel, dtype=dtype)

    def map_peer_windows(self, kinds) -> None:
        pass

    def close(self) -> None:
        self._close_plane()


class Update(StepUpdate):
    """One norm group; the update adds 1 to the window (so pulls can tell steps apart)."""

    def __init__(self, transport, fail_with=None, squares=None):
        self.transport = transport
        self.fail_with = fail_with
        self.squares = squares
        self.norms = None

    def squared_norms(self):
        if self.squares is not None:
            return torch.tensor([self.squares], dtype=torch.float64)
        return self.transport.local_grad_accumulator().double().square().sum().reshape(1)

    def apply(self, norms):
        self.norms = norms
        if self.fail_with is not None:
            raise self.fail_with
        self.transport.local_param_window().add_(1.0)


def runtime_for(transport, numel=16):
    layout = WindowLayout()
    layout.add_trainable(0, numel * transport.world_size, numel)
    return ODCRuntime(transport, layout, MicroBatchLedger())
