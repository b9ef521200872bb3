"""What the ranks run for ``test_config_fuzz.py``: initialize each generated ds_config, train one
optimizer step with the valid ones, and record every outcome (an error's type, message and where
its traceback ends) for the parent to judge against its oracle.

Every config runs in the same two ranks, one after the other: spawning ranks per config would cost
seconds each on a 2-core machine. A barrier after each config keeps the ranks in lockstep, so a
config that fails on one rank only shows up as a disagreement (or a hang the harness names), not as
a misattributed outcome of the next config.
"""
from __future__ import annotations

import copy
import gc
import math
import os
import re
import sys
import threading
import time
import traceback

import deepspeed
import torch.distributed as tdist

from tests.support.workloads import make_model, micro_batch, mse_mean, mse_token_sum


def _where(path: str) -> str:
    """A traceback frame's file, shortened to the package it belongs to (``ds_odc/config.py``,
    ``deepspeed/runtime/config.py``, ``pydantic/main.py``, ``torch/optim/adam.py``...)."""
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("ds_odc", "deepspeed", "pydantic", "torch", "tests"):
        if anchor in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(anchor):])
    return path


def _describe(err: BaseException) -> dict:
    frames = traceback.extract_tb(err.__traceback__)
    return {
        "type": type(err).__name__,
        "module": type(err).__module__,
        "message": str(err),
        "frames": [(_where(f.filename), f.lineno, f.name) for f in frames],
        "traceback": "".join(traceback.format_exception(type(err), err, err.__traceback__)[-12:]),
    }


def _train_one_step(engine) -> dict:
    """Run one optimizer step: ``gradient_accumulation_steps`` micro-batches, ``step()`` after each
    (managed accumulation) or once at the end (unmanaged: the caller owns the boundary)."""
    rank = tdist.get_rank()
    # DeepSpeed derives missing batch sizes dividing by a float world size when the config has a
    # "sequence_parallel_size" key (even 1): 1.0 micro-batches is still one
    gas = int(engine.gradient_accumulation_steps())
    micro = int(engine.train_micro_batch_size_per_gpu())
    dtype = next(p for p in engine.module.parameters()).dtype
    options = getattr(engine, "odc_options", None)
    per_token = options is not None and options.loss_normalization == "token"
    managed = engine.managed_gradient_accumulation()
    losses = []
    for index in range(gas):
        x, y, mask = micro_batch(0, rank, index, size=micro)
        pred = engine(x.to(dtype))
        if per_token:
            loss = mse_token_sum(pred, y, mask)
            engine.backward(loss, loss_tokens=int(mask.sum().item()))
        else:
            loss = mse_mean(pred, y)
            engine.backward(loss)
        losses.append(loss.item())
        if managed:
            engine.step()
    if not managed:
        engine.step()
    return {"engine": type(engine).__name__, "global_steps": engine.global_steps, "gas": gas, "micro": micro,
            "dtype": str(dtype), "losses_finite": all(math.isfinite(v) for v in losses),
            "stage": int(engine.zero_optimization_stage())}


_SEGMENT = re.compile(r"ds_odc_[0-9a-f]+_r\d+_\w+")


def _resources(collect: bool) -> dict:
    """What ODC holds in this process: threads, mappings of its shared-memory segments and open
    files among them (``collect``: after a garbage collection, which frees an engine that failed in
    initialize)."""
    if collect:
        gc.collect()
    with open("/proc/self/maps") as maps:
        mapped = {match.group(0) for line in maps for match in [_SEGMENT.search(line)] if match}
    files = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            match = _SEGMENT.search(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if match:
            files.add(f"{fd}:{match.group(0)}")
    return {"threads": {t.name for t in threading.enumerate()}, "mapped": mapped, "files": files}


def _new(before: dict, after: dict) -> dict:
    return {key: sorted(after[key] - before[key]) for key in before}


def _leftovers(directory: str) -> list:
    try:
        return sorted(name for name in os.listdir(directory) if name.startswith("ds_odc_"))
    except FileNotFoundError:
        return []


def run_configs(configs, private_shm_dir):
    """For each config: initialize (and train one step if that worked), then record
    ``{"outcome": "ok", ...}`` or ``{"outcome": "error", "phase", "type", "message", "frames", ...}``, plus
    the ``ds_odc_*`` files left in ``private_shm_dir`` (the shm_dir some configs name; nothing else
    writes there) and what the config left in this process (``new_resources``)."""
    rank = tdist.get_rank()
    results = []
    for index, config in enumerate(configs):
        print(f"[rank {rank}] config {index}: {config!r}", flush=True)
        record: dict = {}
        engine = None
        before = _resources(collect=False)  # the previous config's garbage only disappears from it
        start = time.perf_counter()
        try:
            # canonicalize rewrites the dict in place: keep the parent's copy as generated
            engine, *_ = deepspeed.initialize(model=make_model(), config=copy.deepcopy(config))
            record.update(outcome="ok", **_train_one_step(engine))
        except Exception as err:  # noqa: BLE001 - every outcome goes back to the parent
            record.update(outcome="error", phase="train" if engine is not None else "initialize", **_describe(err))
        finally:
            if engine is not None:
                try:
                    engine.destroy()
                except Exception as err:  # noqa: BLE001
                    record["destroy_error"] = _describe(err)
        record["seconds"] = time.perf_counter() - start
        tdist.barrier()  # both ranks are done with this config (and its segments) before anyone looks
        record["leftovers"] = _leftovers(private_shm_dir)
        # A garbage collection costs ~1 s here: only after an initialize that failed while building the engine
        # (it may have allocated windows, and only a collection frees what it did not hand over). An engine
        # that trained was destroyed, and DeepSpeed keeps it alive anyway (see the test).
        built = any(frame[0] == "deepspeed/runtime/engine.py" for frame in record.get("frames", ()))
        record["new_resources"] = _new(before, _resources(collect=record.get("phase") == "initialize" and built))
        print(f"[rank {rank}] config {index}: {record['outcome']} {record.get('type', '')}", flush=True)
        results.append(record)
        tdist.barrier()
    sys.stdout.flush()
    return results
