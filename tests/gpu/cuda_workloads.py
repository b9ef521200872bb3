"""What the ranks run in the GPU training tests (the transport contract's workloads are shared
with every transport: tests/distributed/transport_workloads.py).

Ranks are spawned by tests/distributed/harness.py with ``env=gpu_env(world)`` (placement:
tests/distributed/transports.py).
"""
from __future__ import annotations

import torch.distributed as tdist

from tests.distributed.transports import rank_device
from tests.distributed.workloads import ds_config, full_params, make_model, micro_batch, mse_mean


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
