"""Transport conformance workloads: the Transport contract exercised directly, no DeepSpeed engine.

Every workload takes the transport's name and runs unchanged on each (``tests/support/transports.py``
places the ranks and says where the windows live); data is made on the host with seeded generators
and moved to the windows' device, so the test process can compute the exact expectation."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as tdist

from ds_odc.comm import WindowSpec, create_transport
from ds_odc.comm.batch import Transfer
from ds_odc.runtime.round_kinds import RoundKind
from tests.support.transports import CASES

#: Window dtypes the pull checks cover, and the element offsets (aligned and not) they read from.
PULL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PULL_OFFSETS = (0, 1, 101)
PULL_LENGTHS = (16, 17)


def _transport(name, timeout_s=10.0, stripe_numel=1024, param_numel=4096, grad_numel=8192,
               param_dtype=torch.bfloat16, grad_dtype=torch.float32):
    device = CASES[name].device()
    kwargs = {"stripe_numel": stripe_numel} if name == "shm" else {}
    transport = create_transport(name, rank=tdist.get_rank(), world_size=tdist.get_world_size(),
                                 timeout_s=timeout_s, device=str(device), **kwargs)
    transport.allocate(WindowSpec(param_numel, param_dtype, grad_numel, exchange_width=8, grad_dtype=grad_dtype))
    return transport


def window_values(numel, dtype, owner):
    """What owner ``owner`` writes into its parameter window (computed on the host)."""
    return torch.arange(numel, dtype=torch.float32).to(dtype) + owner


def reads_and_exchanges(name):
    """For each window dtype: every rank writes its window, one exchange, every rank reads every
    window at aligned and misaligned offsets. Then five plain rounds."""
    seen, rows, kinds = {}, None, set()
    for dtype in PULL_DTYPES:
        transport = _transport(name, param_dtype=dtype)
        rank, world = transport.rank, transport.world_size
        window = transport.local_param_window()
        kinds.add((transport.name, window.device.type, str(window.dtype)))
        window.copy_(window_values(window.numel(), dtype, rank).to(window.device))
        rows = transport.exchange(RoundKind.TEST, 0, torch.tensor([float(rank), 1.0]), "a test rendezvous")
        batch = []
        for owner in range(world):
            for offset in PULL_OFFSETS:
                for length in PULL_LENGTHS:
                    out = torch.empty(length, dtype=dtype, device=window.device)
                    transport.read(owner, offset, out)
                    seen[(str(dtype), owner, offset, length)] = out.cpu()  # used on the caller's stream at once
                    batch.append(Transfer(owner, offset,
                                          torch.full((length,), -1.0, dtype=dtype, device=window.device)))
        handle = transport.read_many(batch)  # the same reads, in one call
        handle.wait()
        assert handle.is_completed() or window.device.type == "cuda"  # a stream may still be copying
        for transfer in batch:
            key = ("batched", str(dtype), transfer.owner, transfer.offset, transfer.tensor.numel())
            seen[key] = transfer.tensor.cpu()
        rounds = [transport.exchange(RoundKind.TEST, 0, torch.tensor([float(i)]), "round").sum().item()
                  for i in range(5)]
        transport.close()
    return {"kinds": sorted(kinds), "rows": rows.tolist(), "seen": seen, "rounds": rounds}


def _random_pushes(rank, world, numel, repeats):
    """(owner, offset, chunk) of rank ``rank``: overlapping, misaligned, stripe-crossing, bf16 and fp32."""
    gen = torch.Generator().manual_seed(7 + rank)
    for i in range(repeats):
        owner = i % world
        offset = int(torch.randint(0, numel - 3000, (1,), generator=gen))
        chunk = torch.randn(3000, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        yield owner, offset, chunk


def concurrent_accumulate(name, accumulator="fp32", repeats=200, batch=1):
    """All ranks add random chunks into every owner at once; each returns its accumulator. ``batch``
    > 1: the same pushes, ``batch`` at a time through ``accumulate_many`` (several owners each)."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[accumulator]
    transport = _transport(name, grad_dtype=dtype)
    numel = transport.local_grad_accumulator().numel()
    device = transport.local_grad_accumulator().device
    pending = []
    for owner, offset, chunk in _random_pushes(transport.rank, transport.world_size, numel, repeats):
        if batch == 1:
            transport.accumulate(owner, offset, chunk.to(device))
            continue
        pending.append(Transfer(owner, offset, chunk.to(device)))
        if len(pending) == batch:
            transport.accumulate_many(pending).wait()
            pending = []
    if pending:
        transport.accumulate_many(pending).wait()
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "fence")
    mine = transport.local_grad_accumulator().cpu().clone()
    transport.close()
    return mine


def expected_accumulation(world, numel=8192, repeats=200):
    expected = [torch.zeros(numel, dtype=torch.float64) for _ in range(world)]
    for rank in range(world):
        for owner, offset, chunk in _random_pushes(rank, world, numel, repeats):
            expected[owner][offset:offset + 3000] += chunk.double()
    return expected


def large_misaligned_push(name, numel=3_000_001):
    """Every rank adds ``rank + 1`` into owner 0 at offset 1 (not 16-byte aligned), in fp32 and bf16:
    a size no chunking divides evenly. Integer sums are exact in fp32."""
    transport = _transport(name, grad_numel=numel + 8, stripe_numel=1 << 20)
    device = transport.local_grad_accumulator().device
    ones = torch.ones(numel, device=device)
    transport.accumulate(0, 1, ones * (transport.rank + 1))
    transport.accumulate(0, 1, (ones * (transport.rank + 1)).to(torch.bfloat16))
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "fence")
    accumulator = transport.local_grad_accumulator().cpu().clone()
    transport.close()
    return accumulator


def pusher_killed(name, timeout_s=5.0):
    """Rank 1 pushes into rank 0, then is SIGKILLed; rank 0's fence must name it, quickly."""
    transport = _transport(name, timeout_s=timeout_s)
    device = transport.local_grad_accumulator().device
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "start")
    if transport.rank == 1:
        transport.accumulate(0, 0, torch.ones(1000, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "the step fence")
        outcome = {"error": None}
    except Exception as err:  # noqa: BLE001 - the error is the result
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome["waited_s"] = time.monotonic() - start
    transport.close()
    return outcome


def push_holder_dies(name, hold_s=1.0):
    """Rank 1 enters a push into rank 0 (its ``push_guard``), stays there ``hold_s`` and is SIGKILLed
    there; rank 0 pushes into the same range meanwhile: its push must wait for a live holder where the
    guard excludes (shm's stripe locks), complete soon after the holder died, and add exactly once."""
    transport = _transport(name, timeout_s=5.0)
    device = transport.local_grad_accumulator().device
    if transport.rank == 1:
        with transport.push_guard(0, 0, 10):
            transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "inside a push")
            time.sleep(hold_s)
            os.kill(os.getpid(), signal.SIGKILL)
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "inside a push")
    start = time.monotonic()
    transport.accumulate(0, 0, torch.ones(10, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    waited = time.monotonic() - start
    value = transport.local_grad_accumulator()[:10].sum().item()
    transport.close()
    return {"waited_s": waited, "sum": value}
