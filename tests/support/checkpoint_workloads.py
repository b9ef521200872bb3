"""What the ranks run in the checkpoint tests: resharding (N -> M ranks) and a crash mid-save.

The resharding runs keep the *global* batch the same whatever the world size: every step has
``SLOTS`` micro-batches, ``micro_batch(step, slot, 0)``; with ``world`` ranks each rank runs
``SLOTS / world`` of them with ``gradient_accumulation_steps = SLOTS / world``. So a 2-rank run, a
1-rank run and their mixtures compute the same updates (up to summation order).
"""
from __future__ import annotations

import os
import subprocess
import sys

import deepspeed
import torch.distributed as tdist

from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_mean

SLOTS = 4  # divides by every world size the tests use (1, 2, 4)
RESHARD_TOLERANCE = 1e-5  # the same global batch, summed in another order (micro-batches vs ranks)


def _engine(seed=1234, universal=False, odc=None):
    world = tdist.get_world_size()
    config = ds_config("odc", gas=SLOTS // world, scheduler=True,  # warmup: the LR changes every step
                       **({"odc": odc} if odc else {}))
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=make_model(seed=seed), config=config)
    return engine


def _train_slots(engine, first_step, steps):
    """Run ``steps`` optimizer steps; return {step: {slot: loss}} of this rank's slots."""
    world, rank = tdist.get_world_size(), tdist.get_rank()
    mine = range(rank * SLOTS // world, (rank + 1) * SLOTS // world)
    losses = {}
    for step in range(first_step, first_step + steps):
        for slot in mine:
            x, y, _ = micro_batch(step, slot, 0)
            loss = mse_mean(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.setdefault(step, {})[slot] = loss.item()
    return losses


def train_and_save(ckpt_dir, save_after=3, then=2, odc=None):
    """Train ``save_after`` steps, save (tag ``saved``), train ``then`` more. Rank 0 returns the
    full parameters at the save and at the end; every rank its slot losses. ``odc``: the engine's odc options."""
    engine = _engine(odc=odc)
    losses = _train_slots(engine, 0, save_after)
    engine.save_checkpoint(ckpt_dir, tag="saved")
    saved = full_params(engine)
    losses.update(_train_slots(engine, save_after, then))
    final = full_params(engine)
    step_count = _adam_step(engine)
    lr = engine.get_lr()
    engine.destroy()
    return {"losses": losses, "saved": saved, "final": final, "adam_step": step_count, "lr": lr}


def load_and_continue(ckpt_dir, tag, first_step=3, steps=2, universal=True, odc=None):
    """A fresh engine (other initial weights) at this world size loads ``tag`` and trains on."""
    engine = _engine(seed=999, universal=universal, odc=odc)
    engine.load_checkpoint(ckpt_dir, tag=tag)
    loaded = full_params(engine)
    loaded_step = _adam_step(engine)
    losses = _train_slots(engine, first_step, steps)
    final = full_params(engine)
    result = {"engine": type(engine).__name__, "loaded": loaded, "losses": losses, "final": final,
              "loaded_adam_step": loaded_step, "global_steps": engine.global_steps, "lr": engine.get_lr()}
    engine.destroy()
    return result


def to_universal(ckpt, tag):
    out = os.path.join(ckpt, f"{tag}_universal")
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", os.path.join(ckpt, tag),
           "--output_folder", out, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return os.path.basename(out)


def merged_losses(results):
    merged = {}
    for result in results:
        for step, slots in result["losses"].items():
            merged.setdefault(step, {}).update(slots)
    return merged


def _adam_step(engine):
    """The optimizer's step count of this rank's first shard (None without optimizer state)."""
    state = engine.optimizer.optimizer.state
    for value in state.values():
        if "step" in value:
            return float(value["step"])
    return None


# -- a crash in the middle of save_checkpoint ---------------------------------------------------------
def save_then_crash_mid_save(ckpt_dir, crash_rank):
    """Save tag ``first`` completely; train a step; save tag ``second`` but ``crash_rank`` dies
    (SIGKILL) while writing its ZeRO shard file. Returns (from the surviving ranks) the params of
    the first checkpoint; the survivor's save either raises or hangs: the test bounds it."""
    import signal

    engine = _engine()
    _train_slots(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir)  # tag global_step2
    saved = full_params(engine)
    _train_slots(engine, 2, 1)
    if tdist.get_rank() == crash_rank:
        original = engine.checkpoint_engine.save

        def save_and_die(state_dict, path):
            original(state_dict, path)
            if "optim_states" in os.path.basename(path):
                with open(path, "r+b") as half_written:  # as if the process died inside torch.save
                    half_written.truncate(os.path.getsize(path) // 2)
                os.kill(os.getpid(), signal.SIGKILL)

        engine.checkpoint_engine.save = save_and_die
    tdist.barrier()
    result = {"saved": saved}
    try:
        engine.save_checkpoint(ckpt_dir)  # tag global_step3
        result["second_save"] = "completed"
    except Exception as err:  # noqa: BLE001 - the error is the result
        result["second_save"] = f"{type(err).__name__}: {err}"
    return result


def load_latest(ckpt_dir):
    """Load whatever ``latest`` names and return its tag and the loaded parameters."""
    engine = _engine(seed=999)
    path, _ = engine.load_checkpoint(ckpt_dir)
    result = {"path": path, "loaded": full_params(engine) if path else None}
    engine.destroy()
    return result
