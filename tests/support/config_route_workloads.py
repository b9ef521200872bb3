"""What the ranks run in the config-route tests: a training loop shaped like the frameworks that build
their ds_config in code from an integer ``zero_stage`` and branch on ``stage == 3`` themselves (OpenRLHF's
``get_train_ds_config``, verl's DeepSpeed engine): ``zero.Init`` when the stage is 3, a dynamic batch of
several backward calls, one step. No ``"stage": "odc"`` anywhere: ODC is asked for by the marker form
(an odc block next to stage 3) or by the environment switch."""
from __future__ import annotations

import os

import deepspeed
import torch.distributed as tdist

from tests.support.workloads import full_params, make_model, micro_batch, mse_mean


def framework_ds_config(zero_stage: int, odc_block=None) -> dict:
    """The framework's own builder: an int stage, its own keys, optionally the odc block (marker form). SGD
    without clipping where frameworks use AdamW with clipping: what is tested is the route, and under Adam and
    clipping an update from a third of the gradient (OpenRLHF's calls not summed) is the same update."""
    zero = {"stage": zero_stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 10_000}
    if odc_block is not None:
        zero["odc"] = odc_block
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 0.0,
            "steps_per_print": 10_000, "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}},
            "zero_optimization": zero}


def framework_training(counts, odc_block=None, steps=3, env=None):
    """Rank r runs ``counts[r]`` micro-batches a step, setting the boundary on its own last one (as
    accelerate does); ``env`` is set in this rank first (the environment switch). Returns what the
    framework's ``stage == 3`` branches saw, the engine's class, and the parameters."""
    os.environ.update(env or {})
    rank = tdist.get_rank()
    zero_stage = 3
    config = framework_ds_config(zero_stage, odc_block)
    branches = []
    if config["zero_optimization"]["stage"] == 3:  # the framework's check, before and after DeepSpeed reads it
        branches.append("zero.Init")
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = make_model()
    else:
        model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    if config["zero_optimization"]["stage"] == 3 and engine.zero_optimization_stage() == 3:
        branches.append("16-bit save path")
    for step in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            engine.set_gradient_accumulation_boundary(index == counts[rank] - 1)
            engine.backward(mse_mean(engine(x), y))
            engine.step()
    result = {"engine": type(engine).__name__, "branches": branches, "params": full_params(engine),
              "stage_in_config": config["zero_optimization"]["stage"]}
    engine.destroy()
    return result


def initialize_outcome(env_by_rank):
    """``deepspeed.initialize`` of a framework-built stage-3 config with ``env_by_rank[rank]`` set in this rank:
    the engine class, or the error and how long it took."""
    import time

    os.environ.update(env_by_rank[tdist.get_rank()])
    start = time.monotonic()
    try:
        engine, *_ = deepspeed.initialize(model=make_model(), config=framework_ds_config(3))
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"error": type(err).__name__, "message": str(err), "waited_s": time.monotonic() - start}
    kind = type(engine).__name__
    engine.destroy()
    return {"error": None, "engine": kind}


def caller_accumulated_training(counts, steps=3, env=None):
    """OpenRLHF's actor update (its dynamic batch): GAS 1 in the config, ``counts[rank]`` backward calls whose
    losses the caller scales, then one ``step()``. ZeRO-3 sums the backward calls (every one is a boundary)
    and averages over ranks; SGD, because Adam's update hardly shows a gradient scaled by a constant."""
    os.environ.update(env or {})
    rank = tdist.get_rank()
    config = framework_ds_config(3)
    config.update(gradient_accumulation_steps=1, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = make_model()
    engine, *_ = deepspeed.initialize(model=model, config=config)
    for step in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            engine.backward(mse_mean(engine(x), y) / counts[rank])
        engine.step()
    result = {"engine": type(engine).__name__, "params": full_params(engine)}
    engine.destroy()
    return result
