"""What the ranks of tests/distributed/test_mutant_gaps.py run: behaviour the rest of the suite did not pin down,
found by seeding the defects of tests/mutants/."""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as tdist

from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean


def persistent_params_after_step(stage) -> dict:
    """One training step (small layers: every parameter is persistent, DeepSpeed's default threshold), then what a
    script sees of each persistent parameter right after ``engine.step()``, before any forward: ZeRO-3 gathers them
    again after its step, so each is available with its updated full value."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config(stage, gas=1, managed=False,
                                                                          optimizer="sgd", clip=0.0))
    persistent = list(engine.optimizer.persistent_parameters)
    x, y, _ = micro_batch(0, tdist.get_rank(), 0)
    engine.backward(mse_mean(engine(x), y))
    before = [p.data.detach().clone() for p in persistent]
    engine.step()
    seen = {"count": len(persistent),
            "status": [p.ds_status.name for p in persistent],
            "values": [p.data.detach().clone() for p in persistent],
            "moved": [not torch.equal(b, p.data) for b, p in zip(before, persistent)]}
    engine.destroy()
    return seen


def failed_initialize_after_the_optimizer() -> dict:
    """``deepspeed.initialize`` that fails after DeepSpeed built the ODC optimizer (a scheduler parameter its class
    does not take: DeepSpeed configures the scheduler after the ZeRO optimizer): the error, then what of ds_odc the
    process still holds."""
    import gc

    from tests.support.protocol_workloads import _shared_memory_in_use

    config = ds_config("odc", scheduler=True)
    config["scheduler"]["params"]["no_such_parameter"] = 1
    try:
        deepspeed.initialize(model=make_model(), config=config)
        error = None
    except TypeError as err:
        error = str(err)
    gc.collect()
    return {"error": error, **_shared_memory_in_use()}


def load_with_a_slow_owner(checkpoint_dir: str) -> dict:
    """Train 2 steps and save; train 2 more; load the checkpoint with rank 1 slow to write its shards (it sleeps
    before loading its ZeRO partitions, as a rank on a slower disk does). Returns the model's output on one batch
    right after the save and right after the load: a resumed engine must compute what the saved one did."""
    import time

    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc", gas=1, managed=False,
                                                                          optimizer="sgd", clip=0.0))
    probe, _, _ = micro_batch(9, 0, 0)

    def train(step):
        x, y, _ = micro_batch(step, rank, 0)
        engine.backward(mse_mean(engine(x), y))
        engine.step()

    for step in range(2):
        train(step)
    engine.save_checkpoint(checkpoint_dir, tag="saved")
    with torch.no_grad():
        saved = engine(probe).detach().clone()
    for step in range(2, 4):
        train(step)
    if rank == 1:
        load_partitions = engine._load_zero_checkpoint

        def slowly(*args, **kwargs):
            time.sleep(3.0)
            return load_partitions(*args, **kwargs)

        engine._load_zero_checkpoint = slowly
    engine.load_checkpoint(checkpoint_dir, tag="saved")
    with torch.no_grad():
        loaded = engine(probe).detach().clone()
    engine.destroy()
    return {"saved": saved, "loaded": loaded}
