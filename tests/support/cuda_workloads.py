"""What the ranks run in the GPU training tests (the transport contract's workloads are shared
with every transport: tests/support/transport_workloads.py).

Ranks are started by tests/support/harness.py with ``env=rank_env(name, world)`` (placement:
tests/support/transports.py): on ``cuda_ipc`` they are spawned with DeepSpeed's CUDA accelerator,
so ``engine.device`` is the rank's GPU and every batch is moved there. The same functions run on ``shm``
(CPU ranks) when the validation kit's ``--cpu-smoke`` asks for it.

A *schedule* lists, per rank, the micro-batches it runs each step, as (data rank, index) pairs of
:func:`~tests.support.workloads.micro_batch`: the same global batch split differently over ranks
must give the same update, so a one-rank run of the concatenated schedule is the reference.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as tdist

from tests.support.transports import CASES
from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_mean, mse_token_sum

MODES = ("managed", "token")


def _config(mode: str, bf16: bool, accumulator: str):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    odc = {"accumulator_dtype": accumulator}
    if mode == "managed":
        # gas is fixed and each rank sets its own boundary (as accelerate does): gradients arrive divided by
        # gas everywhere, and the step divides by global micro-batches / gas, whatever the split
        return ds_config("odc", gas=2, bf16=bf16, odc=odc)
    # per-token: each rank sums its tokens' losses and says how many tokens it had; the step divides by
    # the global count
    return ds_config("odc", bf16=bf16, managed=False, odc=odc)


def _train(engine, mine, steps: int, mode: str) -> list:
    device, dtype = engine.device, engine.module.inp.weight.dtype
    losses = []
    for step in range(steps):
        for position, (data_rank, index) in enumerate(mine):
            x, y, mask = micro_batch(step, data_rank, index)
            x, y, mask = x.to(device, dtype), y.to(device), mask.to(device)
            if mode == "managed":
                engine.set_gradient_accumulation_boundary(position == len(mine) - 1)
                loss = mse_mean(engine(x), y)
                engine.backward(loss)
                engine.step()
            else:
                loss = mse_token_sum(engine(x), y, mask)
                engine.backward(loss, loss_tokens=int(mask.sum().item()))
            losses.append(loss.item())
        if mode == "token":
            engine.step()
    return losses


def train_schedule(name, schedule, steps=5, bf16=False, accumulator="fp32", mode="managed"):
    """Rank r runs ``schedule[r]`` each step on transport ``name``; returns what it saw and the full
    fp32 parameters after ``steps`` steps."""
    CASES[name].device()  # the rank's device, selected before DeepSpeed places the engine
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config(mode, bf16, accumulator))
    transport = engine.optimizer.odc.transport
    record = {"transport": transport.name, "engine_device": str(engine.device),
              "window_device": str(transport.local_param_window().device),
              "window_dtypes": (str(transport.local_param_window().dtype),
                                str(transport.local_grad_accumulator().dtype)),
              "backend": tdist.get_backend()}
    record["losses"] = _train(engine, schedule[tdist.get_rank()], steps, mode)
    record["params"] = {k: v.cpu() for k, v in full_params(engine).items()}
    engine.destroy()
    return record


def train_references(name, cases, steps=5):
    """One rank, several engines one after the other (one process start for every reference):
    ``cases`` is a list of (key, micro-batches, bf16, accumulator, mode); returns key -> params."""
    if tdist.get_world_size() != 1:
        raise ValueError("references run on one rank")
    return {key: train_schedule(name, [mine], steps, bf16, accumulator, mode)["params"]
            for key, mine, bf16, accumulator, mode in cases}


def smoke(name):
    """One rank, one step: what the rank's process is (accelerator, device, transport) and a finite loss."""
    from deepspeed.accelerator import get_accelerator

    record = train_schedule(name, [[(0, 0), (0, 1)]], steps=1)
    return {"accelerator": get_accelerator()._name, "env": os.environ.get("DS_ACCELERATOR"),
            "engine_device": record["engine_device"], "transport": record["transport"],
            "window_device": record["window_device"], "losses": record["losses"],
            "cuda_initialized": torch.cuda.is_initialized()}


def offload_param_training(name, stage, micro_batches, steps=3):
    """``offload_param: {"device": "cpu"}`` with the model on the rank's device (``stage`` "odc" or 3), Adam,
    unmanaged accumulation, ``micro_batches`` a step: the shards live in host memory, so ODC pulls from and
    pushes into host windows while forward and backward run on the GPU. Returns where things live and the
    full fp32 parameters after ``steps`` steps."""
    CASES[name].device()
    import deepspeed

    zero = {"offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config(stage, gas=1, managed=False, **zero))
    device = engine.device
    for step in range(steps):
        for index in range(micro_batches):
            x, y, _ = micro_batch(step, 0, index)
            engine.backward(mse_mean(engine(x.to(device)), y.to(device)))
        engine.step()
    odc = getattr(engine.optimizer, "odc", None)
    record = {"engine_device": str(device), "backend": tdist.get_backend(),
              "transport": odc.transport.name if odc is not None else None,
              "window_device": str(odc.transport.local_param_window().device) if odc is not None else None,
              "params": {k: v.cpu() for k, v in full_params(engine).items()}}
    engine.destroy()
    return record


def fp16_training(name, stage, steps=4, overflow_step=1):
    """fp16 with dynamic loss scaling on the rank's device (``stage`` "odc" or 3), Adam, one micro-batch a
    step, unmanaged accumulation. At ``overflow_step`` the loss is multiplied by inf, so every gradient
    overflows: the step must be skipped and the loss scale halved, as ZeRO-3 does. Returns, per step, the loss,
    the loss scale after the step and the skipped-step count, the optimizer's class and the full fp32
    parameters at the end. The odc stage refuses fp16 unless ``DS_ODC_EXPERIMENTAL_FP16=1``."""
    CASES[name].device()
    import deepspeed

    config = ds_config(stage, gas=1, managed=False)
    config["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 1000, "hysteresis": 1,
                      "min_loss_scale": 1}
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    device, dtype = engine.device, engine.module.inp.weight.dtype
    trace = []
    for step in range(steps):
        x, y, _ = micro_batch(step, 0, 0)
        loss = mse_mean(engine(x.to(device, dtype)), y.to(device))
        engine.backward(loss * float("inf") if step == overflow_step else loss)
        engine.step()
        trace.append({"loss": loss.item(), "scale": float(engine.optimizer.loss_scale),
                      "skipped": int(engine.skipped_steps)})
    record = {"dtype": str(dtype), "optimizer": type(engine.optimizer).__name__, "trace": trace,
              "params": {k: v.cpu() for k, v in full_params(engine).items()}}
    engine.destroy()
    return record
