"""What the ranks run in the GPU tests: the transport contract and training, on CUDA tensors.

Ranks are spawned by tests/distributed/harness.py with ``env=gpu_env(world)``: DeepSpeed's CUDA
accelerator, gloo for the (rare, start-up only) collectives, and, when there are fewer GPUs than
ranks, every rank on GPU 0 (several processes may share one GPU through CUDA IPC; NCCL could not).
"""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as tdist

from ds_odc.comm.rendezvous import RoundKind
from ds_odc.comm import WindowSpec, create_transport
from tests.distributed.workloads import ds_config, full_params, make_model, micro_batch, mse_mean


def gpu_env(world: int) -> dict:
    env = {"DS_ACCELERATOR": "cuda"}
    if torch.cuda.device_count() < world:
        env["LOCAL_RANK"] = "0"  # every rank on GPU 0; DeepSpeed places the engine by LOCAL_RANK
    return env


def rank_device() -> torch.device:
    """The GPU of this rank, consistent with :func:`gpu_env`."""
    count = torch.cuda.device_count()
    index = tdist.get_rank() if count >= tdist.get_world_size() else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _transport(name="cuda_ipc", timeout_s=10.0, param_numel=4096, grad_numel=8192, grad_dtype=torch.float32):
    transport = create_transport(name, rank=tdist.get_rank(), world_size=tdist.get_world_size(),
                                 timeout_s=timeout_s, device=str(rank_device()))
    transport.allocate(WindowSpec(param_numel, torch.bfloat16, grad_numel, exchange_width=8, grad_dtype=grad_dtype))
    return transport


def reads_and_exchanges(name="auto"):
    """As the shm conformance workload, on GPU windows; "auto" must pick cuda_ipc for CUDA shards."""
    transport = _transport(name)
    rank, world = transport.rank, transport.world_size
    window = transport.local_param_window()
    window.copy_(torch.arange(window.numel(), dtype=torch.float32, device=window.device).to(torch.bfloat16) + rank)
    rows = transport.exchange(RoundKind.TEST, 0, torch.tensor([float(rank), 1.0]), "a test rendezvous")
    seen = []
    for owner in range(world):
        out = torch.empty(16, dtype=torch.bfloat16, device=window.device)
        transport.read(owner, 100, out)
        seen.append(out.float().cpu().tolist())  # used on the caller's stream right after the pull
    rounds = [transport.exchange(RoundKind.TEST, 0, torch.tensor([float(i)]), "round").sum().item() for i in range(5)]
    result = {"name": transport.name, "rows": rows.tolist(), "seen": seen, "rounds": rounds,
              "window_device": str(window.device)}
    transport.close()
    return result


def concurrent_accumulate(accumulator="fp32", repeats=200):
    """The shm workload's random, overlapping, misaligned bf16/fp32 pushes, from every rank at once."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}[accumulator]
    transport = _transport(grad_dtype=dtype)
    rank, world = transport.rank, transport.world_size
    numel = transport.local_grad_accumulator().numel()
    gen = torch.Generator().manual_seed(7 + rank)
    for i in range(repeats):
        owner = i % world
        offset = int(torch.randint(0, numel - 3000, (1,), generator=gen))
        chunk = torch.randn(3000, generator=gen).to(torch.bfloat16 if i % 2 else torch.float32)
        transport.accumulate(owner, offset, chunk.to(transport.device))
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "fence")
    mine = transport.local_grad_accumulator().cpu().clone()
    transport.close()
    return mine


def large_misaligned_push(numel=3_000_001):
    """Every rank adds ``rank + 1`` into owner 0 at offset 1 (not 16-byte aligned), in bf16 and fp32:
    many grid-stride iterations, a head and a tail. Integer sums are exact in fp32."""
    transport = _transport(grad_numel=numel + 8)
    rank = transport.rank
    ones = torch.ones(numel, device=transport.device)
    transport.accumulate(0, 1, ones * (rank + 1))
    transport.accumulate(0, 1, (ones * (rank + 1)).to(torch.bfloat16))
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "fence")
    accumulator = transport.local_grad_accumulator().cpu().clone()
    transport.close()
    return accumulator


def pusher_killed(timeout_s=5.0):
    """Rank 1 pushes into rank 0, then is SIGKILLed; rank 0's fence must name it, quickly."""
    transport = _transport(timeout_s=timeout_s)
    transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "start")
    if transport.rank == 1:
        transport.accumulate(0, 0, torch.ones(1000, device=transport.device))
        torch.cuda.synchronize()
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


def train_schedule(schedule, steps=5, bf16=False, accumulator="fp32"):
    """Managed accumulation where rank r runs the micro-batches ``schedule[r]`` (list of (rank, index)
    of :func:`micro_batch`) each step; the boundary is each rank's own last micro-batch. The same
    global batch split differently over ranks must give the same update."""
    device = rank_device()
    rank = tdist.get_rank()
    # gas is fixed and each rank sets its own boundary (as accelerate does): gradients arrive divided by
    # gas everywhere, and the step divides by global micro-batches / gas, whatever the split
    cfg = ds_config("odc", gas=2, bf16=bf16, odc={"accumulator_dtype": accumulator})
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    transport = engine.optimizer.odc.transport
    record = {"transport": transport.name, "window_device": str(transport.local_param_window().device),
              "window_dtypes": (str(transport.local_param_window().dtype),
                                str(transport.local_grad_accumulator().dtype)), "losses": []}
    dtype = engine.module.inp.weight.dtype
    for step in range(steps):
        mine = schedule[rank]
        for position, (data_rank, index) in enumerate(mine):
            x, y, _ = micro_batch(step, data_rank, index)
            engine.set_gradient_accumulation_boundary(position == len(mine) - 1)
            loss = mse_mean(engine(x.to(device, dtype)), y.to(device))
            engine.backward(loss)
            engine.step()
            record["losses"].append(loss.item())
    record["params"] = {k: v.cpu() for k, v in full_params(engine).items()}
    engine.destroy()
    return record
