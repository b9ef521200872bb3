"""Workloads for the step-protocol and failure-model tests (run inside spawned ranks)."""
from __future__ import annotations

import time

import deepspeed
import torch
import torch.distributed as tdist

from ds_odc.comm import WindowSpec, create_transport
from ds_odc.runtime import MicroBatchLedger, ODCRuntime, StepUpdate, WindowLayout
from tests.support.workloads import ds_config, full_params, make_model, micro_batch, mse_mean, mse_token_sum


def _error(err: BaseException) -> tuple:
    return type(err).__name__, str(err)


def slow_rank_and_a_retried_step(timeout_s: float, delay_s: float):
    """Rank 0 does host-side work for ``delay_s`` (> timeout) between its last backward and step;
    rank 1 catches the error it gets at the step and steps again (a "resilient" loop). Returns the
    outcome of every step call of this rank."""
    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config(
        "odc", managed=False, odc={"timeout_s": timeout_s}))
    outcomes = []
    for step in range(3):
        x, y, _ = micro_batch(step, rank, 0)
        try:
            engine.backward(mse_mean(engine(x), y))
        except Exception as err:  # noqa: BLE001 - refused after the failure
            outcomes.append(("backward",) + _error(err))
            break
        if step == 1 and rank == 0:
            time.sleep(delay_s)
        for _attempt in range(2):
            try:
                engine.step()
                outcomes.append(("step", "ok", ""))
                break
            except Exception as err:  # noqa: BLE001
                outcomes.append(("step",) + _error(err))
    phase = engine.odc_phase.value
    engine.destroy()
    return {"outcomes": outcomes, "phase": phase}


def mixed_normalisation_rules():
    """Rank 0 reports loss tokens, rank 1 does not: the step fails on both; later forwards are refused."""
    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc", managed=False))
    x, y, mask = micro_batch(0, rank, 0)
    pred = engine(x)
    if rank == 0:
        engine.backward(mse_token_sum(pred, y, mask), loss_tokens=int(mask.sum()))
    else:
        engine.backward(mse_mean(pred, y))
    found = {}
    try:
        engine.step()
    except Exception as err:  # noqa: BLE001
        found["step"] = _error(err)
    try:
        engine(x)
    except Exception as err:  # noqa: BLE001
        found["forward"] = _error(err)
    found["phase"] = engine.odc_phase.value
    engine.destroy()
    return found


def initialize_with(config_odc: dict, model_kw_by_rank=None):
    """Try to build an engine; return the error (type, message), or the engine's ODC timeout."""
    model_kw = (model_kw_by_rank or {}).get(tdist.get_rank(), {})
    try:
        engine, *_ = deepspeed.initialize(model=make_model(**model_kw), config=ds_config("odc", odc=config_odc))
    except Exception as err:  # noqa: BLE001
        return _error(err)
    timeout = engine.optimizer.odc.transport.timeout_s
    engine.destroy()
    return {"timeout_s": timeout}


# -- memory ordering: owners publish versioned patterns, pullers check every pull -----------------------
class _VersionUpdate(StepUpdate):
    """The owner writes version ``v`` into every element of its shard, element by element order
    reversed, so a reader that overtook the writer would see two versions in one pull."""

    def __init__(self, window: torch.Tensor, version: int):
        self.window, self.version = window, version

    def squared_norms(self):
        return torch.zeros(1, dtype=torch.float64)

    def apply(self, norms):
        for chunk in reversed(self.window.split(257)):
            chunk.fill_(float(self.version))


def versioned_publish_stress(steps: int, shard_numel: int):
    """Every step: each rank pulls the whole parameter (every owner's shard) a random number of
    times and checks that all elements carry the version published at the last step, then the
    owners write the next version. Returns the number of pulls checked."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    transport = create_transport("shm", rank=rank, world_size=world, timeout_s=60.0)
    transport.allocate(WindowSpec(shard_numel, torch.float32, shard_numel, exchange_width=8))
    layout = WindowLayout()
    layout.add_trainable(0, shard_numel * world, shard_numel)
    runtime = ODCRuntime(transport, layout, MicroBatchLedger())
    generator = torch.Generator().manual_seed(rank)
    out = torch.empty(shard_numel * world)
    checked = 0
    for version in range(steps):
        for _ in range(int(torch.randint(1, 4, (1,), generator=generator))):
            runtime.pull(0, out)
            seen = out.unique()
            if seen.numel() != 1 or int(seen[0]) != version:
                raise AssertionError(f"step {version}: a pull saw versions {seen.tolist()}")
            checked += 1
        if rank == version % world:
            time.sleep(0.001)  # one owner is late each step: the others wait at the fence
        runtime.step(_VersionUpdate(transport.local_param_window(), version + 1))
    runtime.close()
    return checked


# -- liveness across pid namespaces ------------------------------------------------------------------------
def liveness_script() -> str:
    """A rank program for separate pid namespaces: rank 1 dies after the first step; rank 0 must
    report it at its next step (and must not take it for dead before)."""
    return r'''
import os, sys, time, json
import deepspeed, torch, ds_odc
from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean
deepspeed.init_distributed("gloo")
rank = int(os.environ["RANK"])
engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc", managed=False, odc={"timeout_s": 60}))
result = {"pid_seen_by_self": os.getpid()}
for step in range(3):
    x, y, _ = micro_batch(step, rank, 0)
    engine.backward(mse_mean(engine(x), y))
    if step == 1 and rank == 1:
        os._exit(3)
    started = time.monotonic()
    try:
        engine.step()
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
        result["waited_s"] = time.monotonic() - started
        break
    result["steps"] = step + 1
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
'''



def uncaught_exception_script() -> str:
    """A rank program launched as a plain script: rank 1 dies of an uncaught ValueError after its
    first step; rank 0 must raise at its next step with that error."""
    return r'''
import os, time, json
import deepspeed, torch, ds_odc
from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean
deepspeed.init_distributed("gloo")
rank = int(os.environ["RANK"])
engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc", managed=False, odc={"timeout_s": 60}))
for step in range(3):
    x, y, _ = micro_batch(step, rank, 0)
    engine.backward(mse_mean(engine(x), y))
    if step == 1 and rank == 1:
        raise ValueError("the data loader gave up")
    try:
        engine.step()
    except Exception as err:
        print("RESULT " + json.dumps({"error": f"{type(err).__name__}: {err}", "steps": step}), flush=True)
        os._exit(0)
print("RESULT " + json.dumps({"error": None}), flush=True)
'''


# -- soak --------------------------------------------------------------------------------------------------
def soak_counts(steps: int, world: int, seed: int = 5) -> torch.Tensor:
    """Micro-batches per rank per step, 0-2 (zero included), the same on every rank and in the reference."""
    return torch.randint(0, 3, (steps, world), generator=torch.Generator().manual_seed(seed))


def soak(steps: int, rss_after: int):
    """Many steps with random per-rank micro-batch counts, per-token normalisation. Returns the final
    fp32 parameters and this rank's resident memory after ``rss_after`` steps and at the end."""
    import psutil

    rank, world = tdist.get_rank(), tdist.get_world_size()
    counts = soak_counts(steps, world)
    config = ds_config("odc", managed=False, lr=1e-3, odc={"accumulator_dtype": "fp64"})
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    rss = {}
    for step in range(steps):
        for index in range(int(counts[step, rank])):
            x, y, mask = micro_batch(step, rank, index)
            engine.backward(mse_token_sum(engine(x), y, mask), loss_tokens=int(mask.sum()))
        engine.step()
        if step + 1 in (rss_after, steps):
            rss[step + 1] = psutil.Process().memory_info().rss
    params = full_params(engine)
    engine.destroy()
    return {"params": params, "rss": rss}


def soak_reference(steps: int, world: int, lr: float = 1e-3, clip: float = 1.0) -> dict:
    """The same updates in one process, on the global batch of each step (plain PyTorch, float64
    accumulation of the micro-batch gradients as the fp64 accumulators do)."""
    from tests.support.workloads import clip_like_deepspeed

    model = make_model()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    counts = soak_counts(steps, world)
    for step in range(steps):
        sums = [torch.zeros_like(p, dtype=torch.float64) for p in trainable]
        tokens = 0
        for rank in range(world):
            for index in range(int(counts[step, rank])):
                x, y, mask = micro_batch(step, rank, index)
                grads = torch.autograd.grad(mse_token_sum(model(x), y, mask), trainable)
                for total, grad in zip(sums, grads):
                    total += grad.double()
                tokens += int(mask.sum())
        for param, total in zip(trainable, sums):
            param.grad = (total / max(tokens, 1)).float()
        clip_like_deepspeed(model, clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _shared_memory_in_use() -> dict:
    """This process's mappings and open files of ds_odc segments (unlinked ones included)."""
    import os
    import re

    segment = re.compile(r"ds_odc_[0-9a-f]+_r\d+_[a-z]+")
    maps = sorted({m.group(0) for line in open("/proc/self/maps") if (m := segment.search(line))})
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if segment.search(target):
            fds.append(target)
    return {"mapped": maps, "files": sorted(fds)}


def destroyed_engine_releases_shared_memory():
    """Train a step, destroy the engine: nothing of ds_odc stays mapped or open, the model stays usable."""
    import gc

    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc"))
    x, y, _ = micro_batch(0, rank, 0)
    engine.backward(mse_mean(engine(x), y))
    engine.step()
    before = full_params(engine)["out.weight"]
    during = _shared_memory_in_use()
    module = engine.module
    engine.destroy()
    del engine
    gc.collect()
    after = _shared_memory_in_use()
    with deepspeed.zero.GatheredParameters([module.out.weight]):  # ZeRO-3's own gather, from private shards
        weight = module.out.weight.detach().float().clone()
    return {"during": during, "after": after, "same_weights": bool(torch.equal(weight, before))}
