"""What the ranks run in the ``offload_states`` / ``reload_states`` tests (see test_offload_states.py).

Each workload trains the same steps twice in the same ranks, once plainly and once with the engine
calls under test in the middle, and returns both records: the test asserts they are bit-identical.
"""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as tdist
from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

from tests.support.workloads import (
    ds_config,
    full_params,
    make_model,
    micro_batch,
    mse_mean,
    mse_token_sum,
    summed_grads,
)

#: DeepSpeed's Adam (FusedAdam: what ``offload_states`` of the optimizer's states requires).
FUSED_ADAM = {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0}}


def _config(stage, bf16=False, managed=True, odc=None, **zero):
    cfg = ds_config(stage, bf16=bf16, managed=managed, **({"odc": odc} if odc and stage == "odc" else {}), **zero)
    cfg["optimizer"] = FUSED_ADAM
    return cfg


def _states(names):
    return None if names is None else [OffloadStateTypeEnum(name) for name in names]


def _micro_batches(engine, step, indices, token):
    rank = tdist.get_rank()
    losses = []
    dtype = next(p for p in engine.module.parameters()).dtype
    for index in indices:
        x, y, mask = (t.to(engine.device) for t in micro_batch(step, rank, index))
        pred = engine(x.to(dtype))
        if token:
            loss = mse_token_sum(pred, y, mask)
            engine.backward(loss, loss_tokens=int(mask.sum().item()))
        else:
            loss = mse_mean(pred, y)
            engine.backward(loss)
        losses.append(loss.item())
    return losses


def _train(stage, counts, steps, calls, bf16, mid_accumulation, token, pin_memory, non_blocking, odc, frozen, zero,
           transport):
    """``calls``: {step: include} of the steps before which offload_states(include)/reload_states run
    (after that step's first micro-batch when ``mid_accumulation``: the gradients pushed so far must
    survive); include lists state names (None: every state). Records the losses, the summed gradients each step
    reads (before it: parameters alone hide a difference in a sum's last bits) and the parameters after it."""
    rank = tdist.get_rank()
    if transport is not None:  # a GPU suite's rank: its device selected before DeepSpeed places the engine
        from tests.support.transports import CASES

        CASES[transport].device()
    engine, *_ = deepspeed.initialize(model=make_model(frozen=frozen),
                                      config=_config(stage, bf16=bf16, managed=False, odc=odc, **zero))
    record: dict = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        first = 0
        if step in calls and mid_accumulation and counts[rank] > 0:
            record["losses"] += _micro_batches(engine, step, [0], token)
            first = 1
        if step in calls:
            engine.offload_states(include=_states(calls[step]), pin_memory=pin_memory, non_blocking=non_blocking)
            engine.reload_states(non_blocking=non_blocking)
        record["losses"] += _micro_batches(engine, step, range(first, counts[rank]), token)
        record["grads"].append(summed_grads(engine))
        engine.step()
        record["params"].append({k: v.cpu() for k, v in full_params(engine).items()})
    engine.destroy()
    return record


def offload_round_trip(options: dict):
    """The run without the calls, then the same run with offload_states/reload_states before each
    step of ``options["calls"]``: ``{"plain": record, "offloaded": record}``. ``options`` override
    :data:`DEFAULTS`; ``frozen``: the model has a frozen layer (ZeRO-3's own ``offload_states`` of
    ``lp_params`` fails on one: it maps frozen shards into the trainable flat buffer)."""
    options = {**DEFAULTS, **options}
    calls = options.pop("calls")
    return {"plain": _train(calls={}, **options), "offloaded": _train(calls=calls, **options)}


DEFAULTS = dict(stage="odc", counts=(1, 1), steps=5, calls={2: None}, bf16=False, mid_accumulation=False, token=False,
                pin_memory=True, non_blocking=False, odc=None, frozen=True, zero={}, transport=None)


# -- an RL rollout's shape: a trained policy and a frozen reference, both offloaded around the rollout ----
def rollout_round_trip(offload: bool, counts=(1, 3), steps=4, offload_at=2):
    """A policy (training engine) and a reference (frozen engine), parameters released after every use;
    rank r scores ``counts[r]`` micro-batches with the reference and trains on them. Before step
    ``offload_at`` both engines' states are offloaded and reloaded (when ``offload``), as RL frameworks do
    around a rollout. Returns the losses and the policy's parameters after every step."""
    from tests.support.frozen_workloads import RELEASED, frozen_config

    rank = tdist.get_rank()
    reference_config = frozen_config("odc")
    reference_config["bf16"] = {"enabled": True}
    reference, *_ = deepspeed.initialize(model=make_model(seed=7), config=reference_config)
    # bf16 gradients summed in the fp64 accumulator: exact whatever order the ranks' pushes arrive in
    policy_config = _config("odc", bf16=True, managed=False, odc={"accumulator_dtype": "fp64"}, **RELEASED)
    policy, *_ = deepspeed.initialize(model=make_model(), config=policy_config)
    record = {"losses": [], "params": [], "away_while_offloaded": None}
    for step in range(steps):
        if offload and step == offload_at:
            policy.offload_states()
            reference.offload_states()
            away = policy.odc_runtime.windows_away | reference.odc_runtime.windows_away
            record["away_while_offloaded"] = sorted(away)
            reference.reload_states()
            policy.reload_states()
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            with torch.no_grad():
                anchor = reference(x.bfloat16()).float()
            loss = mse_mean(policy(x.bfloat16()), anchor + y)
            policy.backward(loss)
            record["losses"].append(loss.item())
        policy.step()
        record["params"].append(full_params(policy))
    reference.destroy()
    policy.destroy()
    return record


# -- what must be named on every rank ---------------------------------------------------------------------
def _timed(fn):
    """Run ``fn``; (error type name, message, seconds it took), or (None, None, seconds)."""
    import time

    started = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - returned to the test
        return type(err).__name__, str(err), time.monotonic() - started
    return None, None, time.monotonic() - started


def misuse(case: str, timeout_s: float = 60.0):
    """One rank does what it must not; returns what each rank's call raised, and how long it waited.

    ``pull_while_offloaded``: rank 0 runs a forward between offload_states and reload_states, rank 1
    waits in reload_states. ``one_rank_only``: rank 0 calls offload_states, rank 1 trains on to the step.
    ``different_states``: rank 0 offloads the parameters, rank 1 the gradients."""
    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(),
                                      config=_config("odc", managed=False, odc={"timeout_s": timeout_s}))
    x, y, _ = micro_batch(0, rank, 0)
    engine.backward(mse_mean(engine(x), y))
    engine.step()
    if case == "pull_while_offloaded":  # rank 1 may learn of it at the end of its own offload_states already
        outcome = _timed(lambda: (engine.offload_states(), engine(x) if rank == 0 else engine.reload_states()))
    elif case == "one_rank_only":
        def train_on():
            engine.backward(mse_mean(engine(x), y))
            engine.step()
        outcome = _timed(engine.offload_states if rank == 0 else train_on)
    else:
        state = OffloadStateTypeEnum.lp_params if rank == 0 else OffloadStateTypeEnum.lp_grads
        outcome = _timed(lambda: engine.offload_states(include=[state]))
    phase = engine.odc_phase.value
    engine.destroy()
    return {"error": outcome[0], "message": outcome[1], "seconds": outcome[2], "phase": phase}


def reload_refused_then_retried(failing_rank: int = 1, steps: int = 4):
    """Rank ``failing_rank`` cannot make its windows again at the first reload_states (as a device a
    rollout engine still holds): every rank must raise, naming it, with the windows still away; the
    second reload_states succeeds and training goes on. Returns the errors, what was away after the
    refusal, and the run's losses and parameters (to compare with a run without the calls)."""
    import errno

    import ds_odc.comm.shm as shm
    from ds_odc.comm.segments import SegmentSpaceError

    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("odc", managed=False))
    record: dict = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        if step == 2:
            engine.offload_states()
            if rank == failing_rank:  # the shm directory is full for the first segment made again
                original = shm.create_reserved

                def full(path, nbytes, original=original):
                    shm.create_reserved = original
                    raise SegmentSpaceError(path, nbytes, OSError(errno.ENOSPC, "No space left on device"))

                shm.create_reserved = full
            record["refused"] = _timed(engine.reload_states)[:2]
            record["away_after_refusal"] = sorted(engine.odc_runtime.windows_away)
            engine.reload_states()
        record["losses"] += _micro_batches(engine, step, [0], token=False)
        record["grads"].append(summed_grads(engine))
        engine.step()
        record["params"].append(full_params(engine))
    engine.destroy()
    return record


def windows_unmapped_while_away():
    """Which of this process's mappings are ODC window files: before offload_states, while away, and after
    reload_states (shm transport), and which ODC files are left in shm_dir at the end."""
    import os

    def mapped_windows():
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                           for line in maps if "ds_odc_" in line})

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("odc", managed=False))
    shm_dir, session = engine.odc_options.shm_dir, engine.odc_runtime.transport._session
    before = mapped_windows()
    engine.offload_states()
    away = mapped_windows()
    engine.reload_states()
    after = mapped_windows()
    engine.backward(mse_mean(engine(micro_batch(0, 0, 0)[0]), micro_batch(0, 0, 0)[1]))
    engine.step()
    engine.destroy()
    tdist.barrier()
    leftovers = sorted(n for n in os.listdir(shm_dir) if n.startswith(f"ds_odc_{session}"))
    return {"session": session, "before": before, "away": away, "after": after, "leftovers": leftovers}


# -- the other engine calls that replace or move ZeRO-3's partitioned buffers after initialize -------------
def _steps(engine, first, steps, record):
    for step in range(first, first + steps):
        record["losses"] += _micro_batches(engine, step, [0], token=False)
        engine.step()
        record["params"].append(full_params(engine))


def after_empty_partition_cache(call: bool, steps: int = 4):
    """Train; before step 2 (when ``call``) ``engine.empty_partition_cache()`` on the policy and on a frozen
    reference whose forwards feed nothing (its gathered parameters are dropped too)."""
    from tests.support.frozen_workloads import frozen_config

    reference, *_ = deepspeed.initialize(model=make_model(seed=7), config=frozen_config("odc"))
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("odc", managed=False))
    record = {"losses": [], "params": [], "reference": []}
    for step in range(steps):
        if call and step == 2:
            engine.empty_partition_cache()
            reference.empty_partition_cache()
        with torch.no_grad():
            record["reference"].append(reference(micro_batch(step, 0, 0)[0]))
        _steps(engine, step, 1, record)
    reference.destroy()
    engine.destroy()
    return record


def after_destroy_and_initialize(first_engine: bool, steps: int = 3):
    """When ``first_engine``, an engine trains 2 steps and is destroyed first; then a new engine (its own
    model) trains ``steps``: it must train as if it were the process's only one."""
    if first_engine:
        engine, *_ = deepspeed.initialize(model=make_model(seed=5), config=_config("odc", managed=False))
        _steps(engine, 0, 2, {"losses": [], "params": []})
        engine.destroy()
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("odc", managed=False))
    record = {"losses": [], "params": []}
    _steps(engine, 0, steps, record)
    engine.destroy()
    return record


def after_load_module_only(stage, ckpt_dir: str, steps: int = 3):
    """Train 2 steps and save; a new engine (other initial weights) loads the module only
    (``load_checkpoint(load_module_only=True)``: a warm start with fresh optimizer states) and trains on."""
    first, *_ = deepspeed.initialize(model=make_model(), config=_config(stage, managed=False))
    _steps(first, 0, 2, {"losses": [], "params": []})
    first.save_checkpoint(ckpt_dir, tag="warm")
    first.destroy()
    engine, *_ = deepspeed.initialize(model=make_model(seed=99), config=_config(stage, managed=False))
    engine.load_checkpoint(ckpt_dir, tag="warm", load_module_only=True)
    record = {"losses": [], "params": [full_params(engine)]}
    _steps(engine, 2, steps, record)
    engine.destroy()
    return record


def device_memory_while_away(transport: str, hidden: int = 2048):
    """On a GPU transport: the device's free memory before offload_states, while the windows are away, and
    after reload_states (every rank between barriers, so that both ranks' windows are counted), and the
    windows' bytes per rank."""
    from tests.support.transports import CASES

    device = CASES[transport].device()
    engine, *_ = deepspeed.initialize(model=make_model(hidden=hidden, frozen=False),
                                      config=_config("odc", bf16=True, managed=False))
    window = engine.odc_runtime.transport.local_param_window()
    accumulator = engine.odc_runtime.transport.local_grad_accumulator()
    window_bytes = window.numel() * window.element_size() + accumulator.numel() * accumulator.element_size()
    del window, accumulator

    def free():
        torch.cuda.synchronize(device)
        tdist.barrier()
        return torch.cuda.mem_get_info(device)[0]

    before = free()
    engine.offload_states(include=[OffloadStateTypeEnum.lp_params, OffloadStateTypeEnum.lp_grads])
    away = free()
    engine.reload_states()
    after = free()
    engine.destroy()
    return {"window_bytes": window_bytes, "before": before, "away": away, "after": after}


# -- a rank that leaves training while its process stays alive -------------------------------------------
def leaves_training(how: str, marker: str, timeout_s: float = 60.0):
    """Rank 0 meets an exception of its own code after step 1 and leaves training, its process alive:
    ``destroy`` (engine.destroy()), ``destroy_process_group`` (the group torn down, the engine left open) or
    ``finally`` (the group torn down in a ``finally`` while the exception is in flight) or ``idle`` (nothing:
    it just stops). Rank 1 trains on into step 2's fence. Returns what rank 1 raised and
    how long it waited; rank 0 stays alive until rank 1 has its answer."""
    import os
    import time

    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(),
                                      config=_config("odc", managed=False, odc={"timeout_s": timeout_s}))
    for step in range(2):
        _micro_batches(engine, step, [0], token=False)
        engine.step()
    if rank == 0:
        time.sleep(1.0)  # rank 1 is past the last round they shared (a failure record would reach it there)
        try:
            if how == "finally":  # torn down on the way out of the failing code: the exception is in flight
                try:
                    raise AssertionError("memory did not shrink")
                finally:
                    tdist.destroy_process_group()
            raise AssertionError("memory did not shrink")  # the caller's own check, caught by its harness
        except AssertionError:
            if how == "destroy":
                engine.destroy()
        if how == "destroy_process_group":  # after the exception was handled: nothing in flight
            tdist.destroy_process_group()
        deadline = time.monotonic() + 3 * timeout_s
        while not os.path.exists(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    _micro_batches(engine, 2, [0], token=False)
    outcome = _timed(engine.step)
    with open(marker, "w"):
        pass
    return {"error": outcome[0], "message": outcome[1], "seconds": outcome[2]}


def ends_without_destroy(steps: int = 3):
    """Every rank trains to the end and tears its process group down without engine.destroy() (as many
    scripts do): nobody may raise."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("odc", managed=False))
    for step in range(steps):
        _micro_batches(engine, step, [0], token=False)
        engine.step()
    tdist.destroy_process_group()
    return engine.odc_phase.value
