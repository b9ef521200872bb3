"""ZeRO-3 APIs a training script uses between initialize, backward and step, run the same way on
ZeRO-3 and on ODC (see test_zero3_contracts.py). Each returns what the script would observe."""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.utils import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_local_grad,
    safe_set_full_fp32_param,
    safe_set_full_grad,
)

from tests.support.workloads import (
    REFERENCE_CLIP,
    REFERENCE_OPTIMIZER,
    ds_config,
    full_params,
    make_model,
    micro_batch,
    mse_mean,
)

MICRO_BATCHES = 2  # per step and rank, unless a workload says otherwise


def _engine(stage, hidden=7, **cfg):
    """Unmanaged accumulation: each rank runs its micro-batches, then one ``engine.step()`` (the
    boundary), as DeepSpeed's own tests do; ZeRO-3 then needs equal counts, ODC does not."""
    config = ds_config(stage, gas=1, managed=False, **cfg)
    engine, *_ = deepspeed.initialize(model=make_model(hidden=hidden), config=config)
    return engine


def _backward(engine, step, index):
    x, y, _ = micro_batch(step, tdist.get_rank(), index)
    loss = mse_mean(engine(x), y)
    engine.backward(loss)
    return loss.item()


def shard_writes_after_initialize(stage):
    """Every rank rebinds (``ds_tensor.data = t``) or writes in place its own shards right after
    initialize, then runs a forward: the output uses every rank's writes."""
    engine = _engine(stage)
    rank = tdist.get_rank()
    for i, param in enumerate(engine.module.parameters()):
        if i % 2 == 0:
            param.ds_tensor.data = torch.full_like(param.ds_tensor.data, 0.01 * (i + 1) * (rank + 1))
        else:
            param.ds_tensor.data.fill_(-0.02 * (i + 1) * (rank + 1))
    x, _, _ = micro_batch(0, 0, 0)
    out = engine(x).detach().clone()
    engine.destroy()
    return out


def gradient_reads_before_step(stage, counts, zero_options=None):
    """``counts[rank]`` micro-batches, then the gradient reads ZeRO-3 offers before the step."""
    engine = _engine(stage, **(zero_options or {}))
    for index in range(counts[tdist.get_rank()]):
        _backward(engine, 0, index)
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    params = dict(engine.module.named_parameters())
    seen = {"partitions": {g: {i: t.clone() for i, t in group.items()}
                           for g, group in engine.optimizer.get_fp32_grad_partitions().items()},
            "full": {n: safe_get_full_grad(params[n]).clone() for n in names},
            "local": {n: safe_get_local_grad(params[n]).clone() for n in names}}
    if not engine.optimizer.offload_optimizer:  # ZeRO-3 keeps no averaged_gradients under offload
        engine.allreduce_gradients()  # called by the script, as DeepSpeed's own tests do
        seen["averaged"] = [g.clone() for g in engine.optimizer.averaged_gradients[0]]
    engine.step()
    seen["norm"] = engine.get_global_grad_norm()
    seen["offload"] = engine.optimizer.offload_optimizer
    seen["params"] = full_params(engine)
    engine.destroy()
    return seen


def zero_grad_between_backward_and_step(stage, backward_after: bool, odc=None):
    """Two micro-batches, ``optimizer.zero_grad()`` (every rank), then two more (or none) and the step.
    SGD without clipping: the update shows the gradient itself (Adam's first step hides its size). ``odc``: the
    odc stage's options (e.g. a cross_node mode), ignored on ZeRO-3."""
    engine = _engine(stage, optimizer="sgd", clip=0.0, **({"odc": odc} if odc else {}))
    for index in range(MICRO_BATCHES):
        _backward(engine, 0, index)
    engine.optimizer.zero_grad()
    if backward_after:
        for index in range(MICRO_BATCHES):
            _backward(engine, 1, index)
    engine.step()
    params = full_params(engine)
    engine.destroy()
    return params


def collective_writes(stage, odc=None):
    """Writes through ZeRO-3's collective APIs between steps: a gradient set before the step, an
    fp32 master weight set after it, a parameter rewritten under GatheredParameters(modifier_rank=0);
    the forward and the step after each see them. ``odc``: as above."""
    # even sizes: ZeRO-3's safe_set_full_* cut the last rank's slice past an odd parameter's end
    engine = _engine(stage, hidden=8, **({"odc": odc} if odc else {}))
    module = engine.module
    for index in range(MICRO_BATCHES):
        _backward(engine, 0, index)
    safe_set_full_grad(module.out.weight, torch.linspace(-0.5, 0.5, module.out.weight.ds_numel).view(3, 8))
    engine.step()
    seen = {"after_set_grad": full_params(engine)}
    safe_set_full_fp32_param(module.inp.bias, torch.linspace(-1.0, 1.0, module.inp.bias.ds_numel))
    with deepspeed.zero.GatheredParameters([module.blocks[0].weight], modifier_rank=0):
        if tdist.get_rank() == 0:
            module.blocks[0].weight.data.fill_(0.25)
    x, _, _ = micro_batch(5, 0, 0)
    seen["forward"] = engine(x).detach().clone()
    for index in range(MICRO_BATCHES):
        _backward(engine, 2, index)
    engine.step()
    seen["after_step"] = full_params(engine)
    seen["inp_bias"] = safe_get_full_fp32_param(module.inp.bias).clone()
    engine.destroy()
    return seen


def overflow_on_one_rank(stage):
    """fp16's overflow path of ZeRO-3's step (``optimizer.dtype`` set to fp16 after initialize:
    DeepSpeed's CPU accelerator refuses fp16 engines) with a non-finite gradient on rank 0 only:
    every rank must skip the same step, then train on. Returns, per step, whether this rank saw an
    overflow and whether its parameters moved, and the collectives its steps issued."""
    from tests.support import sync_workloads
    engine = _engine(stage, clip=0.0)
    engine.optimizer.dtype = torch.float16
    counter = sync_workloads._counter
    seen = []
    for step in range(2):
        for index in range(MICRO_BATCHES):
            _backward(engine, step, index)
        if step == 0 and tdist.get_rank() == 0:
            engine.optimizer.grad_partitions_flat_buffer[0] = float("inf")  # this owner's shard only
        before = full_params(engine)
        counter.take()
        engine.step()
        collectives = counter.take()
        after = full_params(engine)
        moved = any(not torch.equal(before[n], after[n]) for n in before)
        seen.append({"overflow": bool(engine.optimizer.overflow), "moved": moved, "collectives": collectives})
    engine.destroy()
    return seen


def coalesced_reduction(stage, coalesce: bool, steps: int = 2):
    """DeepSpeed's ``engine.coalesce_grad_reduction()`` around each step's four backward calls (bf16,
    Adam, gradient buckets much smaller than the model, so the flush at the block's exit spans several
    buckets), or the same calls without it. fp64 accumulators on ODC: sums independent of arrival
    order, so a run must equal the other bit for bit. Returns the final fp32 parameters."""
    import contextlib

    odc = {"accumulator_dtype": "fp64"} if stage == "odc" else {}
    config = ds_config(stage, gas=1, bf16=True, clip=0.0, lr=1e-3, contiguous_gradients=True, overlap_comm=True,
                       reduce_bucket_size=64, odc=odc)
    engine, *_ = deepspeed.initialize(model=make_model(hidden=16, layers=3), config=config)
    for step in range(steps):
        with engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext():
            for index in range(4):
                x, y, _ = micro_batch(step, tdist.get_rank(), index)
                loss = mse_mean(engine(x.bfloat16()), y)
                engine.set_gradient_accumulation_boundary(index == 3)
                engine.backward(loss)
        engine.step()
    params = full_params(engine)
    engine.destroy()
    return params


def norm_groups_before_step(stage):
    """``optimizer._get_norm_groups()`` between backward and step (DeepSpeed's own gradient-clipping
    test calls it twice around ``safe_set_local_grad``), then the step. Returns the norms each call saw
    and the parameters after the step."""
    from deepspeed.utils import safe_set_local_grad

    engine = _engine(stage, clip=0.0)
    for index in range(MICRO_BATCHES):
        _backward(engine, 0, index)
    optimizer = engine.optimizer
    seen = {"before": [float(n) for n in optimizer._get_norm_groups()]}
    for param in engine.module.parameters():
        if param.requires_grad:
            safe_set_local_grad(param, torch.clamp(safe_get_local_grad(param), -0.01, 0.01))
    seen["clamped"] = [float(n) for n in optimizer._get_norm_groups()]
    engine.step()
    seen["step_norm"] = float(engine.get_global_grad_norm())
    seen["params"] = full_params(engine)
    engine.destroy()
    return seen


def offload_param_training(stage, counts, steps=3, optimizer_offload=True):
    """``offload_param: {"device": "cpu"}`` (what every framework's ZeRO-3 offload config sets, usually with
    ``offload_optimizer`` too), SGD without clipping (as :func:`reference_training`), unmanaged accumulation: rank
    r runs ``counts[r]`` micro-batches a step.
    Returns the parameters after each step, and where this rank's shards live."""
    zero = {"offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}
    if optimizer_offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = ds_config(stage, gas=1, managed=False, optimizer=REFERENCE_OPTIMIZER, clip=REFERENCE_CLIP, **zero)
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    rank = tdist.get_rank()
    params = []
    for step in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            engine.backward(mse_mean(engine(x), y))
        engine.step()
        params.append(full_params(engine))
    runtime = getattr(engine, "odc_runtime", None)
    shards_in_window = runtime is not None and all(
        p.ds_tensor.data_ptr() == runtime.own_shard(p.ds_id).data_ptr() for p in engine.module.parameters())
    engine.destroy()
    return {"params": params, "shards_in_window": shards_in_window}
