"""What the ranks of test_two_hosts_global.py run (``cross_node: "global"`` on 2 nodes x 2 ranks), inside
two_host_workloads.py's ``cases`` job: each function returns what the test compares."""
from __future__ import annotations

import os
import socket
import time
from typing import Optional

import deepspeed
import torch
import torch.distributed as tdist

from ds_odc.runtime.layout import owner_slices
from tests.support.workloads import (
    REFERENCE_CLIP,
    REFERENCE_OPTIMIZER,
    ds_config,
    full_params,
    make_model,
    micro_batch,
    mse_mean,
)

GLOBAL = {"cross_node": "global"}
SHM = "/dev/shm"


def _runtime(engine):
    return getattr(engine, "odc_runtime", None) or engine.optimizer.odc


def remote_elements(runtime, key: int) -> int:
    """Elements of parameter ``key`` whose owners are on another node than this rank's."""
    slot = runtime.layout.slots[key]
    local_world = runtime.transport.world_size
    return sum(count for owner, _, count in owner_slices(slot.numel, slot.shard_numel, runtime.world_size)
               if owner // local_world != runtime.node)


def record_calls(runtime) -> tuple[list, list]:
    """Wrap the runtime's own pull and push: the keys pulled and pushed from now on, in two lists it fills."""
    pulled: list = []
    pushed: list = []
    pull_many, push = runtime.pull_many, runtime.push

    def recording_pull_many(keys, outs):
        pulled.extend(keys)
        return pull_many(keys, outs)

    def recording_push(key, grad):
        pushed.append(key)
        return push(key, grad)

    runtime.pull_many, runtime.push = recording_pull_many, recording_push
    return pulled, pushed


def traffic() -> dict:
    """One micro-batch and step with every parameter pulled on demand (persistence threshold 0), after a first
    one (the open round): the bytes this rank read from and pushed to other nodes, against what the layout says
    they must be for the parameters it pulled and pushed (recorded by wrapping the runtime's own calls)."""
    cfg = ds_config("odc", stage3_param_persistence_threshold=0, odc=GLOBAL)
    engine, *_ = deepspeed.initialize(model=make_model(layers=2), config=cfg)
    runtime = _runtime(engine)
    pulled, pushed = record_calls(runtime)
    rank = tdist.get_rank()
    for step in range(2):
        if step == 1:
            remote = runtime.remote
            before = (remote.bytes_read, remote.bytes_pushed)
            pulled.clear()
            pushed.clear()
        x, y, _ = micro_batch(step, rank, 0)
        engine.backward(mse_mean(engine(x), y))
        engine.step()
    element = engine.optimizer.lp_param_buffer.element_size()
    result = {
        "bytes_read": remote.bytes_read - before[0], "bytes_pushed": remote.bytes_pushed - before[1],
        "expected_read": sum(remote_elements(runtime, key) for key in pulled) * element,
        "expected_pushed": sum(remote_elements(runtime, key) for key in pushed) * element,
        "pulled": len(pulled), "pushed": len(pushed),
        "params": sum(p.ds_numel for p in engine.module.parameters()),
        "remote_of_every_param": sum(remote_elements(runtime, p.ds_id) for p in engine.module.parameters()),
        "served": (remote.served_reads, remote.served_pushes),
    }
    engine.destroy()
    return result


def memory() -> dict:
    """What this rank allocated (bf16 model, Adam) under global sharding with fp32 and with bf16 accumulators, and
    under ZeRO-3 with its default gradient dtype (the model's), with the model's element counts."""
    result = {"global": _allocated("odc", GLOBAL), "global_bf16": _allocated("odc", {**GLOBAL,
                                                                                    "accumulator_dtype": "bf16"}),
              "zero3": _allocated(3, None), "world": tdist.get_world_size()}
    model = make_model(layers=3, hidden=64)
    result["trainable"] = [p.numel() for p in model.parameters() if p.requires_grad]
    result["frozen"] = [p.numel() for p in model.parameters() if not p.requires_grad]
    return result


def _allocated(stage, odc) -> dict:
    """Bytes of this rank's parameter shards, gradient partitions and optimizer states after one step: on the odc
    stage its windows, on ZeRO-3 its flat shard buffer with the frozen shards beside it and its gradient buffer."""
    config = ds_config(stage, bf16=True, **({"odc": odc} if odc else {}))
    engine, *_ = deepspeed.initialize(model=make_model(layers=3, hidden=64), config=config)
    x, y, _ = micro_batch(0, tdist.get_rank(), 0)
    engine.backward(mse_mean(engine(x.to(torch.bfloat16)), y))
    engine.step()
    optimizer = engine.optimizer
    runtime = getattr(optimizer, "odc", None)
    if runtime is not None:
        window, gradients = runtime.transport.local_param_window(), runtime.transport.local_grad_accumulator()
        params = window.numel() * window.element_size()
    else:
        gradients = optimizer.grad_partitions_flat_buffer
        params = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    masters = optimizer.fp32_partitioned_groups_flat
    state = sum(t.numel() * t.element_size() for s in optimizer.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    result = {"param_bytes": params, "gradient_bytes": gradients.numel() * gradients.element_size(),
              "optimizer_bytes": sum(m.numel() * m.element_size() for m in masters) + state}
    engine.destroy()
    return result


def _refused(initialize) -> Optional[tuple]:
    """The error an ``initialize()`` that must be refused raised, as (type name, text); None if it was not."""
    try:
        engine, *_ = initialize()
    except Exception as err:  # noqa: BLE001 - the error is the result
        return type(err).__name__, str(err)
    engine.destroy()
    return None


def refusals() -> dict:
    """What is not supported with global sharding yet is refused by name on every rank, and the engine goes on:
    ``offload_states()`` on a live engine; at initialize, before any window exists, ``offload_param``,
    ``offload_optimizer`` and the split balance policy (a fixed SP mpu: :func:`sp_refusal`)."""
    from tests.support import sp_workloads, split_workloads
    from tests.support.offload_states_workloads import _config

    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("odc", odc=GLOBAL))
    x, y, _ = micro_batch(0, tdist.get_rank(), 0)
    engine.backward(mse_mean(engine(x), y))
    engine.step()
    result = {}
    try:
        engine.offload_states()
        result["offload_states"] = None
    except Exception as err:  # noqa: BLE001 - the error is the result
        result["offload_states"] = (type(err).__name__, str(err))
    engine.backward(mse_mean(engine(x), y))  # still usable
    engine.step()
    result["phase"] = engine.odc_phase.value
    engine.destroy()
    for offload in ("offload_param", "offload_optimizer"):
        result[offload] = _refused(lambda offload=offload: deepspeed.initialize(model=make_model(), config=ds_config(
            "odc", odc=GLOBAL, **{offload: {"device": "cpu"}})))
    split = split_workloads.ds_config()
    split["zero_optimization"]["odc"].update(GLOBAL)
    model = sp_workloads.tiny_llama()
    result["split"] = _refused(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                            config=split))
    result["shm"] = sorted(os.listdir(SHM))
    return result


def sp_refusal() -> dict:
    """A fixed SP mpu with global sharding is refused at initialize on every rank. Last in its process: the mpu's
    sequence-parallel groups stay registered in DeepSpeed, so every engine made after it would run as SP."""
    from tests.support import sp_workloads

    return {"sequence_parallel": _refused(lambda: sp_workloads.sp_engine("odc", odc=GLOBAL)),
            "shm": sorted(os.listdir(SHM))}


def sp_across_nodes() -> dict:
    """An SP group spanning both nodes (``sequence_parallel_size`` 4 on 2 x 2 ranks, under the default cross_node,
    replicate: global and budget refuse SP whatever its groups, :func:`sp_refusal`) is refused at initialize on
    every rank, naming the group and the ranks not on its node. Last in its process, after :func:`sp_refusal`: a
    refused engine leaves its SP mpu registered in DeepSpeed (``mpu_left``: DeepSpeed sets it before the optimizer is
    built, where the refusal is), and ALST's mpu builds its groups once per process, so they are dropped first."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from deepspeed.utils import groups

    from tests.support import sp_workloads

    left = groups.mpu is parallel_state_sp and parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None
    parallel_state_sp._SEQUENCE_PARALLEL_GROUP = parallel_state_sp._SEQUENCE_DATA_PARALLEL_GROUP = None
    model = sp_workloads.tiny_llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, core_attn_implementation="sdpa",
                                                           sequence_parallel_size=4, micro_batch_size=1)
    refused = _refused(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=sp_workloads.ds_config("odc"), mpu=mpu))
    return {"sequence_parallel": refused, "mpu_left": left, "sp_size": mpu.get_sequence_parallel_world_size(),
            "shm": sorted(os.listdir(SHM))}


def _mapped_segments() -> set:
    """The shared-memory segments this process maps now: their files are unlinked once every rank of the node
    mapped them (/dev/shm no longer lists them), so what lives on is the mapping, "(deleted)" in /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if f"{SHM}/ds_odc_" in line}


def deferred_close(closer: int = 3, reader: int = 0, forwards: int = 3) -> dict:
    """docs/multinode.md: "a rank that closes while peers on other nodes may still read its window keeps it mapped
    until they have closed too". A frozen engine under global sharding (every parameter pulled on demand, a quarter
    of each from rank ``closer``, node 1); every rank runs one forward, then every rank but ``reader`` (node 0)
    destroys its engine. Once ``closer``'s ``destroy()`` has returned (a message of the default group says so:
    not a barrier the destroy could wait on), ``reader`` runs ``forwards`` more forwards, pulling from ``closer``
    and rank 2, both destroyed, then tells ``closer`` and, once ``closer`` has looked, destroys its own engine.
    On ``reader``: the outputs and the pieces read from ``closer``, before and after. On ``closer``: whether its
    server thread still ran, how many reads it served and which of its segments (its windows and its node peer's)
    it still mapped, right after its destroy, after ``reader``'s forwards, and once ``reader`` closed (a bounded
    wait); every rank: its /dev/shm at the end."""
    from tests.support.frozen_workloads import frozen_config

    rank = tdist.get_rank()
    before = _mapped_segments()
    engine, *_ = deepspeed.initialize(model=make_model(), config=frozen_config("odc", **GLOBAL))
    runtime = _runtime(engine)
    remote = runtime.remote
    from_closer: list = []
    read_many = remote.read_many

    def recording_read_many(reads, *args, **kwargs):
        done = read_many(reads, *args, **kwargs)
        from_closer.extend(t.tensor.clone() for t in reads if t.owner == closer)
        return done

    remote.read_many = recording_read_many
    x, _, _ = micro_batch(0, 0, 0)
    with torch.no_grad():
        first = engine(x).clone()
    result: dict = {"mode": runtime.cross_node.mode, "mine": sorted(_mapped_segments() - before)}
    mine = set(result["mine"])
    tdist.barrier()  # every rank has opened its engine and pulled once

    def closer_state(served_from: int) -> dict:
        return {"serving": remote.serving, "served": remote.served_reads - served_from,
                "mapped": sorted(mine & _mapped_segments()), "shm": sorted(os.listdir(SHM))}

    flag = torch.zeros(1)
    if rank == closer:
        served = remote.served_reads
        start = time.monotonic()
        engine.destroy()
        result["destroy_s"] = time.monotonic() - start
        result["after_destroy"] = closer_state(served)
        tdist.send(flag, reader)
        tdist.recv(flag, reader)  # the reader has pulled, and waits to close until this is recorded
        result["after_reads"] = closer_state(served)
        tdist.send(flag, reader)
        end = time.monotonic() + 30
        while (remote.serving or mine & _mapped_segments()) and time.monotonic() < end:
            time.sleep(0.02)
        result["after_all_closed"] = closer_state(served)
    elif rank == reader:
        pulled_before = list(from_closer)
        tdist.recv(flag, closer)
        from_closer.clear()
        with torch.no_grad():
            outputs = [engine(x).clone() for _ in range(forwards)]
        result.update(first=first, outputs=outputs, pulled_before=pulled_before, pulled_after=list(from_closer))
        tdist.send(flag, closer)
        tdist.recv(flag, closer)  # its state recorded: this rank's close (its STOP) would end that server
        engine.destroy()
    else:
        engine.destroy()
    tdist.barrier()
    result["shm"] = sorted(os.listdir(SHM))
    return result


def frozen(counts, stage, options=None) -> dict:
    """A frozen engine (no optimizer), ``counts[rank]`` forwards of the same inputs on each rank; on the odc stage
    with ``options`` (default: global sharding)."""
    from tests.support.frozen_workloads import frozen_config

    rank = tdist.get_rank()
    config = frozen_config(stage, **(options or GLOBAL)) if stage == "odc" else frozen_config(stage)
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    outputs = []
    with torch.no_grad():
        for index in range(counts[rank]):
            x, _, _ = micro_batch(0, 0, index)
            outputs.append(engine(x).clone())
    runtime = _runtime(engine) if stage == "odc" else None
    choice = None if runtime is None else runtime.cross_node
    engine.destroy()
    return {"outputs": outputs, "engine": type(engine).__name__,
            "mode": None if choice is None else (choice.mode, len(choice.replicated_layers))}


def bitwise(counts, steps=3) -> dict:
    """Deterministic sums (order-free) under replicate and under global sharding: the same summed gradients at
    every step and parameters; and both layouts with fp32 accumulators (``<layout>_fp32``), whose sums differ."""
    from tests.support.workloads import train_uneven

    runs = {}
    for exact in (True, False):  # without deterministic sums: the control, the layouts' sums differ
        for name, layout in (("replicate", {}), ("global", GLOBAL)):
            run = train_uneven("odc", "unmanaged", counts, steps=steps, odc={"deterministic": exact, **layout},
                               record_grads=True)
            runs[name if exact else f"{name}_fp32"] = {"params": run["params"], "grads": run["grads"]}
    return runs


def killed(out_dir: str, victim: int, where: str, odc: dict = GLOBAL) -> None:
    """Rank ``victim`` (node 1) is SIGKILLed at ``where`` of step 1 ("forward": before its pulls; "backward":
    after its forward, so that the others' pushes into it fail; "step": after its backward, right before
    ``engine.step()``, so that the others are in the step's fence and its counts' gather when it dies; "sum" /
    "gather": inside the step, as it enters the link's gradient sum / window gather, so that its partner on the
    other node is inside that collective: under the budget BudgetLink's list-form reduce-scatter / all-gather);
    every other rank reports the error it raised, how long it waited from the start of step 1 (``waited_s``) and
    from the kill (``after_kill_s``: the victim writes its clock, CLOCK_MONOTONIC, one clock for both hosts, to
    ``killed_at`` as it dies), and its node's /dev/shm after ``engine.destroy()``. ``odc``: the cross_node options
    (global sharding, or a budget)."""
    rank = tdist.get_rank()
    engine = _engine_after_step_zero(timeout_s=60, odc=odc)
    x, y, _ = micro_batch(1, rank, 0)
    if rank == victim and where in ("sum", "gather"):
        _die_entering(_runtime(engine).link, "reduce_gradients" if where == "sum" else "gather_windows", out_dir)
    if rank == victim and where == "forward":
        _die(out_dir)
    start = time.monotonic()
    result: dict = {"error": None}
    try:
        loss = mse_mean(engine(x), y)
        if rank == victim and where == "backward":
            _die(out_dir)
        engine.backward(loss)
        if rank == victim and where == "step":
            _die(out_dir)
        engine.step()
    except Exception as err:  # noqa: BLE001 - the error is the result
        raised = time.monotonic()
        result = {"error": type(err).__name__, "message": str(err), "waited_s": raised - start}
        killed_at = os.path.join(out_dir, "killed_at")
        if os.path.exists(killed_at):
            with open(killed_at) as stamp:
                result["after_kill_s"] = raised - float(stamp.read())
    result = _destroyed(engine, result)
    _report(out_dir, where, result, [r for r in range(tdist.get_world_size()) if r != victim])
    os._exit(0)


def _die(out_dir: str) -> None:
    """SIGKILL this rank, first writing the time (CLOCK_MONOTONIC, the same on both hosts) to ``killed_at``."""
    import signal

    with open(os.path.join(out_dir, "killed_at.tmp"), "w") as stamp:
        stamp.write(repr(time.monotonic()))
    os.replace(os.path.join(out_dir, "killed_at.tmp"), os.path.join(out_dir, "killed_at"))
    os.kill(os.getpid(), signal.SIGKILL)


def _die_entering(link, method: str, out_dir: str) -> None:
    """SIGKILL this rank as it enters its cross-node link's ``method`` inside the step: killed before
    ``engine.step()``, it is found at the fence and its counts' gather, and the survivors never reach the step's
    later collectives (under the budget, the replicated layers' reduce-scatter and all-gather); killed here,
    its partner on the other node is inside that very collective when it dies."""
    def die(*args, **kwargs):
        _die(out_dir)

    setattr(link, method, die)


def _report(out_dir: str, name: str, result: dict, survivors) -> None:
    """Write this rank's ``result``, then wait (bounded) for every survivor's: rank 0 holds the job's store."""
    import json

    rank = tdist.get_rank()
    path = os.path.join(out_dir, f"{name}_rank{rank}.json")
    with open(path + ".tmp", "w") as out:
        json.dump(result, out)
    os.replace(path + ".tmp", path)
    end = time.monotonic() + 60
    while time.monotonic() < end and not all(os.path.exists(os.path.join(out_dir, f"{name}_rank{r}.json"))
                                             for r in survivors):
        time.sleep(0.05)


def delayed(counts, steps: int = 3) -> dict:
    """Rank 3's updates are slowed (0.5 s before it writes its shards) and so are the pushes it serves from the
    other node (0.05 s each before the add): other ranks must neither pull a shard before its owner has
    updated it nor see an owner update before every push sent to it has landed. Unmanaged mode, uneven counts;
    returns the parameters (the test compares them with one process's)."""
    rank = tdist.get_rank()
    cfg = ds_config("odc", managed=False, optimizer=REFERENCE_OPTIMIZER, clip=REFERENCE_CLIP,
                    stage3_param_persistence_threshold=0, odc=GLOBAL)
    engine, *_ = deepspeed.initialize(model=make_model(), config=cfg)
    runtime = _runtime(engine)
    if rank == 3:
        step, serve_push = runtime.step, runtime.remote._serve_push

        def slow_step(update):
            apply = update.apply

            def slow_apply(norms):
                time.sleep(0.5)
                return apply(norms)

            update.apply = slow_apply
            return step(update)

        def slow_serve_push(*args):
            time.sleep(0.05)
            return serve_push(*args)

        runtime.step, runtime.remote._serve_push = slow_step, slow_serve_push
    for step_index in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step_index, rank, index)
            engine.backward(mse_mean(engine(x), y))
        engine.step()
    result = {"params": full_params(engine)}
    engine.destroy()
    return result


def _engine_after_step_zero(timeout_s: float, odc: dict = GLOBAL):
    """An engine with the cross_node options ``odc`` (global sharding, or a budget) whose every parameter is
    pulled on demand, after step 0 and a barrier."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config(
        "odc", odc={"timeout_s": timeout_s, **odc}, stage3_param_persistence_threshold=0))
    x, y, _ = micro_batch(0, tdist.get_rank(), 0)
    engine.backward(mse_mean(engine(x), y))
    engine.step()
    tdist.barrier()
    return engine


def _step_one(engine) -> dict:
    """Step 1 on this rank: ``{"error": None}``, or the error it raised and how long it waited."""
    start = time.monotonic()
    try:
        x, y, _ = micro_batch(1, tdist.get_rank(), 0)
        engine.backward(mse_mean(engine(x), y))
        engine.step()
    except Exception as err:  # noqa: BLE001 - the error is the result
        return {"error": type(err).__name__, "message": str(err), "waited_s": time.monotonic() - start}
    return {"error": None}


def _destroyed(engine, result: dict) -> dict:
    engine.destroy()
    return {**result, "shm": sorted(os.listdir(SHM)), "host": socket.gethostname()}


def stalled(out_dir: str, odc: dict = GLOBAL, where: str = "forward", victim: int = 3, timeout_s: float = 5.0) -> None:
    """Rank ``victim`` stops (SIGSTOP, resumed 30 s later unless the test kills it first: its pid is in
    ``stopped_pid``) before step 1's forward, or with ``where`` "sum" inside the step as it enters its link's gradient
    sum (its partner on the other node is then inside that collective: under the budget BudgetLink's
    reduce-scatter): the others' pulls from it, their rounds and that collective wait ``timeout_s``, then every
    survivor raises naming it. ``odc``: as :func:`killed`."""
    rank = tdist.get_rank()
    engine = _engine_after_step_zero(timeout_s, odc)
    if rank == victim:
        with open(os.path.join(out_dir, "stopped_pid"), "w") as pid_file:
            pid_file.write(str(os.getpid()))
    if rank == victim and where == "sum":
        link = _runtime(engine).link
        summing = link.reduce_gradients

        def stop_then_sum(*args, **kwargs):
            _stop_for(30)
            return summing(*args, **kwargs)

        link.reduce_gradients = stop_then_sum
    elif rank == victim:
        _stop_for(30)
    result = _destroyed(engine, _step_one(engine))
    if rank != victim:
        _report(out_dir, "stalled", result, [r for r in range(tdist.get_world_size()) if r != victim])
    os._exit(0)


def _stop_for(seconds: float) -> None:
    """SIGSTOP this process; a detached shell resumes it ``seconds`` later (long after the others gave up)."""
    import signal
    import subprocess

    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def cut(out_dir: str, odc: dict = GLOBAL, timeout_s: float = 5.0) -> None:
    """After step 0, every rank says so (``ready_rank<r>``) and waits for the test to cut the link between the
    nodes (``cut`` file); then step 1: every rank raises within a bound, naming a rank of the other node or the
    unreachable store, and leaves its /dev/shm empty. ``odc``: as :func:`killed`."""
    rank = tdist.get_rank()
    engine = _engine_after_step_zero(timeout_s, odc)
    open(os.path.join(out_dir, f"ready_rank{rank}"), "w").close()
    end = time.monotonic() + 60
    while not os.path.exists(os.path.join(out_dir, "cut")) and time.monotonic() < end:
        time.sleep(0.05)
    result = _destroyed(engine, _step_one(engine))
    _report(out_dir, "cut", result, [])  # no waiting: node 1 cannot reach the store any more
    os._exit(0)


def auto() -> dict:
    """cross_node "auto" without a budget, with one too small for any layer, one that some layers fit (400 bytes:
    budget_workloads.BUDGET_BYTES) and a large one: what each resolved to (mode, the logged reason, whether owners
    on the other node are reached remotely), how many groups of every rank initialize made, and the parameters
    after a step that trains (SGD without clipping: a first Adam step is ``lr * sign(g)``, blind to a gradient's
    scale)."""
    outcome = {}
    made = []
    new_group = tdist.new_group

    def counting_new_group(ranks=None, *args, **kwargs):
        made.append(len(ranks) if ranks is not None else tdist.get_world_size())
        return new_group(ranks, *args, **kwargs)

    for name, budget in (("no_budget", None), ("small", 1e-9), ("some", 400 / 2 ** 30), ("large", 1000.0)):
        options = {"cross_node": "auto", **({"node_replica_budget_gb": budget} if budget else {})}
        made.clear()
        tdist.new_group = counting_new_group
        try:
            config = ds_config("odc", optimizer=REFERENCE_OPTIMIZER, clip=REFERENCE_CLIP, odc=options)
            engine, *_ = deepspeed.initialize(model=make_model(), config=config)
        finally:
            tdist.new_group = new_group
        outcome[f"{name}_world_groups"] = made.count(tdist.get_world_size())
        x, y, _ = micro_batch(0, tdist.get_rank(), 0)
        engine.backward(mse_mean(engine(x), y))
        engine.step()
        runtime = _runtime(engine)
        outcome[name] = (runtime.cross_node.mode, runtime.cross_node.reason, runtime.remote is not None)
        outcome[f"{name}_params"] = full_params(engine)  # the same step whatever the layout
        engine.destroy()
    return outcome
