"""Ranks driving :class:`ds_odc.comm.remote.RemoteWindows` directly on one host (its protocol, without engines):
``tests/distributed/test_remote_windows.py``. The engines that use it across real hosts are in global_workloads."""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from ds_odc.comm.batch import Transfer
from ds_odc.comm.remote import READ, REQUEST, RemoteWindows

#: Elements of each rank's window: a reply far larger than a socket's buffers, so that one nobody reads stays
#: unsent (16 MiB of fp32).
WINDOW_NUMEL = 4 << 20
#: Reads of one pipelined batch, and elements each (100 MiB in flight from one owner).
MANY_READS, MANY_NUMEL = 100, 1 << 18


def window_of(rank: int) -> torch.Tensor:
    """Rank ``rank``'s window: its rank + position, fp32 (every rank can say what another's holds)."""
    return torch.arange(WINDOW_NUMEL, dtype=torch.float32) + rank * WINDOW_NUMEL


def _windows(timeout_s: float):
    """This rank's window (its rank + position, fp32), its accumulator, and RemoteWindows over a group of all."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    window = window_of(rank)
    accumulator = torch.zeros(16, dtype=torch.float32)
    group = tdist.new_group(list(range(world)), backend="gloo")
    remote = RemoteWindows(group, rank, world, timeout_s, window=lambda: window,
                           add_own=lambda offset, grad: accumulator.narrow(0, offset, grad.numel()).add_(grad))
    return remote, window, accumulator, group


def stalled_requester(timeout_s: float = 20.0) -> dict:
    """Rank 2 asks rank 0 for its whole window and never reads the reply (a requester stopped mid-pull); then
    rank 1 reads from and pushes to rank 0. Rank 0's server must go on serving rank 1: returns how long rank 1
    waited, and what it got."""
    remote, window, accumulator, group = _windows(timeout_s)
    rank = tdist.get_rank()
    result: dict = {}
    if rank == 2:
        header = torch.tensor([READ, 0, WINDOW_NUMEL, 0], dtype=torch.int64)
        tdist.isend(header, 0, group=group, tag=REQUEST).wait()
    tdist.barrier()  # rank 2's request is in rank 0's server before rank 1 asks
    if rank == 1:
        time.sleep(0.5)  # rank 0's server has taken rank 2's request first
        out = torch.empty(8, dtype=torch.float32)
        start = time.monotonic()
        remote.read_many([Transfer(0, 100, out)])
        remote.accumulate_many([Transfer(0, 4, torch.ones(4))])
        result = {"waited_s": time.monotonic() - start, "read": out.tolist()}
        # many large replies in flight at once (a module's pull): all arrive, every byte where it belongs
        outs = [torch.empty(MANY_NUMEL) for _ in range(MANY_READS)]
        remote.read_many([Transfer(0, (i * MANY_NUMEL) % (WINDOW_NUMEL - MANY_NUMEL), out)
                          for i, out in enumerate(outs)])
        result["many_ok"] = all(bool((out == window_of(0).narrow(0, (i * MANY_NUMEL) % (WINDOW_NUMEL - MANY_NUMEL),
                                                                   MANY_NUMEL)).all()) for i, out in enumerate(outs))
    tdist.barrier()
    if rank == 0:
        result = {"accumulator": accumulator.tolist(), "served_reads": remote.served_reads}
    if rank == 1:
        try:
            remote.read_many([Transfer(0, WINDOW_NUMEL - 4, torch.empty(8))])
        except ValueError as err:
            result["beyond"] = str(err)
    remote.close(wait_s=2.0)
    return result


def requests_to_a_dead_owner(timeout_s: float = 20.0) -> dict:
    """Rank 1 is SIGKILLed; once rank 0's gloo has seen its connection close, rank 0 pushes to it, then reads
    from it. Each request must fail as an ODC error naming rank 1, whether gloo refuses it as it is issued (a
    connection already known closed) or while it is awaited: returns each error's class and message."""
    import os
    import signal

    remote, _, _, group = _windows(timeout_s)
    rank = tdist.get_rank()
    tdist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(2.0)  # rank 1's sockets closed: gloo marks the pair broken, and the next send on it raises at once
    errors = {}
    for name, request in (("push", lambda: remote.accumulate_many([Transfer(1, 0, torch.ones(4))])),
                          ("pull", lambda: remote.read_many([Transfer(1, 0, torch.empty(4))]))):
        try:
            request()
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - the error is the result
            errors[name] = (type(err).__name__, str(err))
    return errors
