"""Transport conformance workloads: the Transport contract exercised directly, no DeepSpeed engine.

Parametrised by transport name so every backend runs the same checks."""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as tdist

from ds_odc.comm.rendezvous import RoundKind
from ds_odc.comm import WindowSpec, create_transport


def _transport(name, timeout_s=10.0, stripe_numel=1024, param_numel=4096, grad_numel=8192):
    transport = create_transport(name, rank=tdist.get_rank(), world_size=tdist.get_world_size(),
                                 timeout_s=timeout_s, stripe_numel=stripe_numel)
    transport.allocate(WindowSpec(param_numel, torch.bfloat16, grad_numel, exchange_width=8))
    return transport


def reads_and_exchanges(name):
    """Every rank writes its window, one exchange, every rank reads every window."""
    transport = _transport(name)
    rank, world = transport.rank, transport.world_size
    window = transport.local_param_window()
    window.copy_(torch.arange(window.numel(), dtype=torch.float32).to(torch.bfloat16) + rank)
    rows = transport.exchange(RoundKind.TEST, 0, torch.tensor([float(rank), 1.0]), "a test rendezvous")
    seen = []
    for owner in range(world):
        out = torch.empty(16, dtype=torch.bfloat16)
        transport.read(owner, 100, out)
        seen.append(out.float().tolist())
    rounds = [transport.exchange(RoundKind.TEST, 0, torch.tensor([float(i)]), "round").sum().item() for i in range(5)]
    transport.close()
    return {"rows": rows.tolist(), "seen": seen, "rounds": rounds}


def concurrent_accumulate(name, repeats=200):
    """All ranks add overlapping, stripe-crossing random chunks into every owner at once."""
    transport = _transport(name)
    rank, world = transport.rank, transport.world_size
    numel = transport.local_grad_accumulator().numel()
    gen = torch.Generator().manual_seed(7 + rank)
    for i in range(repeats):
        owner = i % world
        offset = int(torch.randint(0, numel - 3000, (1,), generator=gen))
        chunk = torch.randn(3000, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        transport.accumulate(owner, offset, chunk)
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "fence")
    mine = transport.local_grad_accumulator().clone()
    transport.close()
    return mine


def expected_accumulation(world, numel=8192, repeats=200):
    expected = [torch.zeros(numel, dtype=torch.float32) for _ in range(world)]
    for rank in range(world):
        gen = torch.Generator().manual_seed(7 + rank)
        for i in range(repeats):
            owner = i % world
            offset = int(torch.randint(0, numel - 3000, (1,), generator=gen))
            chunk = torch.randn(3000, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
            expected[owner][offset:offset + 3000] += chunk.float()
    return expected


def lock_holder_dies(name):
    """Rank 1 takes a stripe lock of rank 0 and is SIGKILLed holding it; rank 0 still pushes."""
    transport = _transport(name, timeout_s=5.0)
    if transport.rank == 1:
        transport._locks[0].acquire(0)
        transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "lock taken")
        os.kill(os.getpid(), signal.SIGKILL)
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "lock taken")
    time.sleep(0.5)
    start = time.monotonic()
    transport.accumulate(0, 0, torch.ones(10))
    waited = time.monotonic() - start
    value = transport.local_grad_accumulator()[:10].sum().item()
    transport.close()
    return {"waited_s": waited, "sum": value}
