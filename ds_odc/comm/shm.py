"""The ``shm`` transport: one-sided windows in shared memory, for the ranks of one host (CPU).

Per rank: a parameter window (compute dtype), a gradient accumulator (fp32), a control block for
the step rendezvous and a lock file for the accumulator stripes, all created once in
:meth:`ShmTransport.allocate` and unlinked as soon as every rank has mapped them.

* pull  = ``out.copy_(peer_window[offset:offset+n])``: a plain read of the peer's pages;
* push  = for each stripe touched: lock, ``peer_acc[a:b].add_(grad)``, unlock. A gradient in
  another dtype (bf16) is converted one stripe at a time: staging is at most one stripe;
* step  = :class:`~ds_odc.comm.rendezvous.StepRendezvous` over the control blocks.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as tdist

from ds_odc.comm.locks import StripeLocks
from ds_odc.comm.rendezvous import StepRendezvous, control_numel
from ds_odc.comm.shm_segment import create_segment, map_segment, segment_path, unlink_quietly
from ds_odc.comm.transport import Transport, WindowSpec, agree_on_session
from ds_odc.errors import ODCConfigError

_KINDS = ("params", "grads", "ctrl", "lock")


class ShmTransport(Transport):
    name = "shm"

    def __init__(self, rank: int, world_size: int, timeout_s: float, shm_dir: str = "/dev/shm",
                 stripe_numel: int = 1 << 20, group=None):
        super().__init__(rank, world_size, timeout_s)
        self.shm_dir = shm_dir
        self.stripe_numel = stripe_numel
        self.group = group
        self._param_windows: list = []
        self._grad_windows: list = []
        self._locks: list = []
        self._rendezvous: StepRendezvous | None = None
        self._closed = False

    # -- allocation (collective, once) ---------------------------------------------------------
    def allocate(self, spec: WindowSpec) -> None:
        self._check_single_host()
        session = agree_on_session(self.rank, self.group)
        mine = {kind: segment_path(self.shm_dir, session, self.rank, kind) for kind in _KINDS}
        sizes = {
            "params": spec.param_numel * _itemsize(spec.param_dtype),
            "grads": spec.grad_numel * _itemsize(spec.grad_dtype),
            "ctrl": control_numel(spec.exchange_width) * 8,
            "lock": 1,
        }
        try:
            for kind, path in mine.items():
                create_segment(path, sizes[kind])
            tdist.barrier(group=self.group)
            controls = []
            for peer in range(self.world_size):
                path = lambda kind: segment_path(self.shm_dir, session, peer, kind)  # noqa: E731
                self._param_windows.append(map_segment(path("params"), spec.param_numel, spec.param_dtype))
                self._grad_windows.append(map_segment(path("grads"), spec.grad_numel, spec.grad_dtype))
                controls.append(map_segment(path("ctrl"), control_numel(spec.exchange_width), torch.float64))
                self._locks.append(StripeLocks(path("lock"), peer, self.timeout_s))
            tdist.barrier(group=self.group)
        except BaseException:
            self.close()
            raise
        finally:
            for path in mine.values():
                unlink_quietly(path)
        self._rendezvous = StepRendezvous(self.rank, controls, spec.exchange_width, self.timeout_s)

    def _check_single_host(self) -> None:
        hosts = [None] * self.world_size
        tdist.all_gather_object(hosts, socket.gethostname(), group=self.group)
        if len(set(hosts)) != 1:
            raise ODCConfigError(
                f"odc.transport='shm' needs every rank on one host, got hosts {sorted(set(hosts))}; "
                "multi-node training needs the hybrid transport (not available yet)")

    # -- one-sided access ------------------------------------------------------------------------
    def local_param_window(self) -> torch.Tensor:
        return self._param_windows[self.rank]

    def local_grad_accumulator(self) -> torch.Tensor:
        return self._grad_windows[self.rank]

    def read(self, owner: int, offset: int, out: torch.Tensor) -> None:
        out.copy_(self._param_windows[owner].narrow(0, offset, out.numel()))

    def accumulate(self, owner: int, offset: int, grad: torch.Tensor) -> None:
        accumulator = self._grad_windows[owner]
        locks = self._locks[owner]
        grad = grad.reshape(-1)
        done, total = 0, grad.numel()
        while done < total:
            position = offset + done
            stripe = position // self.stripe_numel
            count = min(total - done, (stripe + 1) * self.stripe_numel - position)
            locks.acquire(stripe)
            try:
                accumulator.narrow(0, position, count).add_(grad.narrow(0, done, count))
            finally:
                locks.release(stripe)
            done += count

    def heartbeat(self) -> None:
        self._rendezvous.heartbeat()

    def exchange(self, values: torch.Tensor, what: str) -> torch.Tensor:
        self.exchanges += 1
        return self._rendezvous.exchange(values, what)

    # -- teardown ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lock in self._locks:
            lock.close()
        self._locks.clear()
        self._param_windows.clear()
        self._grad_windows.clear()
        self._rendezvous = None


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()
