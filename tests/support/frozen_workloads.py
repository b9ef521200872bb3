"""What the ranks run in the frozen-engine tests: engines built without an optimizer (reference and reward
models), alone and beside a trained policy, with parameters released after every use as ZeRO-3 does for
any model of real size (``stage3_param_persistence_threshold`` 0, ``stage3_max_live_parameters`` 0)."""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as tdist

from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_mean

RELEASED = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0}


def frozen_config(stage, **odc) -> dict:
    """A reference model's ds_config as TRL's ``prepare_deepspeed`` builds it: the training config's
    ZeRO section, no optimizer."""
    config = ds_config(stage, optimizer="client", odc=odc, **RELEASED)
    config.pop("gradient_clipping", None)
    return config


def frozen_forwards(stage, counts, dtype="float32"):
    """A frozen engine alone; rank r runs ``counts[r]`` forwards (no grad) of micro-batches of rank 0 (the
    same inputs everywhere). Returns the outputs, the engine's class and what it pulled."""
    rank = tdist.get_rank()
    model = make_model().to(getattr(torch, dtype))
    engine, *_ = deepspeed.initialize(model=model, config=frozen_config(stage))
    outputs = []
    with torch.no_grad():
        for index in range(counts[rank]):
            x, _, _ = micro_batch(0, 0, index)
            outputs.append(engine(x.to(model.inp.weight.dtype)).clone())
    runtime = getattr(engine, "odc_runtime", None)
    result = {"outputs": outputs, "engine": type(engine).__name__,
              "pulls": runtime.pulls if runtime is not None else None,
              "window": tuple(runtime.transport.local_param_window().shape) if runtime is not None else None}
    engine.destroy()
    result["shard_private"] = all(p.ds_tensor.data_ptr() != 0 for p in engine.module.parameters())
    return result


def policy_with_reference(stage, counts, steps=3):
    """DPO's shape on two engines: a frozen reference model and a trained policy (the same initial weights).
    Each of rank r's ``counts[r]`` micro-batches runs the reference forward (no grad), then the policy's
    forward and backward on a loss that pulls the policy towards the reference's output plus the target;
    every rank steps once per step (unmanaged accumulation: the caller owns the boundary). Returns the
    policy's full parameters after every step."""
    rank = tdist.get_rank()
    reference, *_ = deepspeed.initialize(model=make_model(), config=frozen_config(stage))
    policy_config = ds_config(stage, optimizer="sgd", clip=0.0, managed=False, **RELEASED)
    policy, *_ = deepspeed.initialize(model=make_model(), config=policy_config)
    params = []
    for step in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            with torch.no_grad():
                anchor = reference(x)
            policy.backward(mse_mean(policy(x), anchor + y))
        policy.step()
        params.append(full_params(policy))
    policy.destroy()
    reference.destroy()
    return params


def policy_with_reference_reference(counts, steps=3, lr=1e-2):
    """:func:`policy_with_reference` in one process on the global batch: every rank's micro-batches summed
    and divided by the world size (unmanaged accumulation: the caller's rule, ZeRO-3's arithmetic)."""
    policy, reference = make_model(), make_model()
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=lr, momentum=0.9)
    world = len(counts)
    params = []
    for step in range(steps):
        optimizer.zero_grad()
        for rank, count in enumerate(counts):
            for index in range(count):
                x, y, _ = micro_batch(step, rank, index)
                with torch.no_grad():
                    anchor = reference(x)
                (mse_mean(policy(x), anchor + y) / world).backward()
        optimizer.step()
        params.append({name: p.detach().clone() for name, p in policy.named_parameters()})
    return params

