"""What runs on the two "hosts" of test_two_hosts.py (see netns.py), as a script:

``python two_host_workloads.py isolation OUT_DIR``
    Reports this host's hostname and /dev/shm, creates a file there, waits (bounded) until both
    hosts have, lists /dev/shm again, then waits for the test's ``release`` file so that the test
    can look at the root namespace's /dev/shm while both files exist.

``python two_host_workloads.py train STAGES OUT_DIR`` (under torchrun or the DeepSpeed launcher)
    ``deepspeed.init_distributed("gloo")``, an all_reduce of the rank ids, then for each of the comma-separated
    ``STAGES`` in turn (e.g. ``3,odc``: one launch for both) a few steps of a tiny model under DeepSpeed with
    ``"zero_optimization": {"stage": STAGE}``; writes ``OUT_DIR/hello<rank>.json`` after the all_reduce and
    ``OUT_DIR/<STAGE>/rank<rank>.json`` after each stage. An error in ``deepspeed.initialize`` is written to
    ``OUT_DIR/<STAGE>/error<rank>.json`` and then propagates: the rank exits non-zero with its traceback on
    stderr.

``python two_host_workloads.py cases CASES OUT_DIR`` (under torchrun)
    Runs each case of the comma-separated ``CASES`` (names of :data:`CASES`: a workload of
    ``workloads.py`` and its arguments) in turn in the same ranks, and saves what each rank returns
    to ``OUT_DIR/<case>_rank<rank>.pt``. A case that raises saves ``{"error": ...}`` instead, and
    the rank goes on to the next case only if the error was expected (``fault`` cases).
"""
import json
import os
import socket
import sys
import time

SHM = "/dev/shm"
STEPS = 3  # of the ZeRO-3 training job, and of each parity case


def _write(path, value):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump(value, out)
    os.replace(tmp, path)


def _wait_for(paths, timeout_s):
    end = time.monotonic() + timeout_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > end:
            raise TimeoutError(f"waited {timeout_s} s for {paths}")
        time.sleep(0.05)


def isolation(out_dir):
    host = socket.gethostname()
    before = sorted(os.listdir(SHM))
    mine = f"two_hosts_{host}_{os.getpid()}"
    with open(os.path.join(SHM, mine), "w") as f:
        f.write(host)
    _write(os.path.join(out_dir, f"created_{host}"), mine)
    _wait_for([os.path.join(out_dir, f"created_node{i}") for i in range(2)], 30)
    report = {"host": host, "before": before, "mine": mine, "after": sorted(os.listdir(SHM)),
              "shm_dev": os.stat(SHM).st_dev, "hosts": {h: socket.gethostbyname(h) for h in ("node0", "node1")}}
    _write(os.path.join(out_dir, f"listed_{host}.json"), report)
    _wait_for([os.path.join(out_dir, "release")], 30)
    print(json.dumps(report), flush=True)


def train(stages, out_dir):
    import deepspeed
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    ids = torch.tensor([float(rank)])
    tdist.all_reduce(ids)
    hello = {"rank": rank, "world": world, "host": socket.gethostname(), "local_rank": os.environ.get("LOCAL_RANK"),
             "env_world_size": os.environ.get("WORLD_SIZE"), "rank_sum": ids.item(), "shm": sorted(os.listdir(SHM))}
    _write(os.path.join(out_dir, f"hello{rank}.json"), hello)
    print(f"two-hosts hello {json.dumps(hello)}", flush=True)
    for stage in stages.split(","):
        stage_dir = os.path.join(out_dir, stage)
        os.makedirs(stage_dir, exist_ok=True)
        result = _train_one(stage, hello, stage_dir)
        _write(os.path.join(stage_dir, f"rank{rank}.json"), result)
        print(f"two-hosts done {json.dumps(result)}", flush=True)
    tdist.destroy_process_group()


def _train_one(stage, hello, out_dir):
    import deepspeed
    import torch
    import torch.distributed as tdist

    from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean

    rank, world = hello["rank"], hello["world"]
    config = ds_config(int(stage) if stage.isdigit() else stage)
    try:
        engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    except Exception as err:  # noqa: BLE001 - recorded per rank, then the rank fails as a user's would
        _write(os.path.join(out_dir, f"error{rank}.json"), {**hello, "error": f"{type(err).__name__}: {err}"})
        raise
    eval_x, eval_y, _ = micro_batch(99, 0, 0)
    losses, mean_losses, eval_losses = [], [], []
    for step in range(STEPS):
        x, y, _ = micro_batch(step, rank, 0)  # every rank its own data
        loss = mse_mean(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        tdist.all_reduce(mean)
        losses.append(loss.item())
        mean_losses.append(mean.item() / world)
        with torch.no_grad():  # the same batch everywhere: equal only if every rank holds the same weights
            eval_losses.append(mse_mean(engine(eval_x), eval_y).item())
    engine_type = type(engine).__name__
    engine.destroy()
    tdist.barrier()
    return {**hello, "engine": engine_type, "losses": losses, "mean_losses": mean_losses,
            "eval_losses": eval_losses, "shm_after": sorted(os.listdir(SHM))}


def _parity_configs(optimizer):
    options = {"optimizer": optimizer}
    return [("odc", {**options, "odc": {"accumulator_dtype": "fp64"}}), ("odc", options), (3, options)]


BF16_ACCUMULATORS = {"accumulator_dtype": "bf16"}
#: name -> (workload of workloads.py, its arguments); results are compared by test_two_hosts.py
CASES = {
    "adam_gas3": ("train_pair", lambda: (_parity_configs("adam"), STEPS, 3)),
    "sgd_gas1": ("train_pair", lambda: (_parity_configs("sgd"), STEPS, 1)),
    # bf16 has no exact answer: ODC bf16, ZeRO-3 bf16 and ZeRO-3 fp32 (the bar is ZeRO-3's own bf16 error)
    # ... and ODC with bf16 accumulators (ZeRO-3's gradient bytes; summed over nodes in bf16 at the step)
    "bf16_adam_gas1": ("train_pair", lambda: ([("odc", {"bf16": True}), (3, {"bf16": True}), (3, {}),
                                               ("odc", {"bf16": True, "odc": BF16_ACCUMULATORS})], STEPS, 1)),
    "uneven_unmanaged": ("train_uneven", lambda: ("odc", "unmanaged", UNEVEN["uneven_unmanaged"])),
    "uneven_managed": ("train_uneven", lambda: ("odc", "managed", UNEVEN["uneven_managed"])),
    "uneven_token": ("train_uneven", lambda: ("odc", "token", UNEVEN["uneven_token"], 3, MASKED)),
}
# cross_node "global" (test_two_hosts_global.py): every rank holds its own 1/world; pulls and pushes cross nodes
GLOBAL = {"cross_node": "global"}
CASES.update({
    "global_adam_gas3": ("train_pair", lambda: ([("odc", {"odc": {**GLOBAL, "accumulator_dtype": "fp64"}}),
                                                 ("odc", {"odc": GLOBAL}), (3, {})], STEPS, 3)),
    # ... and budget with bf16 accumulators (the replicated layers summed over nodes in bf16, list form: a budget of
    # its own, as 2 + 2 bytes per element make every layer fit in BUDGET's, which would resolve to replicate)
    "global_bf16_adam_gas1": ("train_pair", lambda: ([("odc", {"bf16": True, "odc": GLOBAL}), (3, {"bf16": True}),
                                                      (3, {}), ("odc", {"bf16": True, "odc": {
                                                          **GLOBAL, **BF16_ACCUMULATORS}}),
                                                      ("odc", {"bf16": True, "odc": {
                                                          **BF16_BUDGET, **BF16_ACCUMULATORS}})], STEPS, 1)),
    "global_uneven_unmanaged": ("train_uneven", lambda: ("odc", "unmanaged", UNEVEN["uneven_unmanaged"], 3, (), 2,
                                                         None, GLOBAL)),
    "global_uneven_managed": ("train_uneven", lambda: ("odc", "managed", UNEVEN["uneven_managed"], 3, (), 2, None,
                                                       GLOBAL)),
    "global_uneven_token": ("train_uneven", lambda: ("odc", "token", UNEVEN["uneven_token"], 3, MASKED, 2, None,
                                                     GLOBAL)),
    # cross_node "auto", resolving to replicate (no budget) and to global (a budget nothing fits in)
    "auto_replicate_uneven": ("train_uneven", lambda: ("odc", "unmanaged", UNEVEN["uneven_unmanaged"], 3, (), 2,
                                                       None, {"cross_node": "auto"})),
    "auto_global_uneven": ("train_uneven", lambda: ("odc", "managed", UNEVEN["uneven_managed"], 3, (), 2, None,
                                                    {"cross_node": "auto", "node_replica_budget_gb": 1e-9})),
})
# cross_node "budget" (test_two_hosts_global.py): some whole layers replicated per node, the rest global
BUDGET = {"cross_node": "budget", "node_replica_budget_gb": 400 / 2 ** 30}  # budget_workloads.BUDGET
# bf16 windows and accumulators cost half: 200 bytes replicate the same 4 of 7 units as BUDGET does in fp32
BF16_BUDGET = {"cross_node": "budget", "node_replica_budget_gb": 200 / 2 ** 30}
# a frozen engine's layers cost only their window copies (p_f bytes each here): 100 bytes hold inp and blocks.0
FROZEN_BUDGET = {"cross_node": "budget", "node_replica_budget_gb": 100 / 2 ** 30}
CASES.update({
    "budget_adam_gas3": ("train_pair", lambda: ([("odc", {"odc": {**BUDGET, "accumulator_dtype": "fp64"}}),
                                                 ("odc", {"odc": BUDGET}), (3, {})], STEPS, 3)),
    "budget_uneven_unmanaged": ("train_uneven", lambda: ("odc", "unmanaged", UNEVEN["uneven_unmanaged"], 3, (), 2,
                                                         None, BUDGET)),
})
#: the failure cases of test_two_hosts_global.py, a launch each: "<mode>_kill_<where>", "<mode>_stalled",
#: "<mode>_cut" under global sharding and under the budget (whose step also runs BudgetLink's collectives)
FAILURE_ODC = {"global": GLOBAL, "budget": BUDGET}
FAILURE_CASES = tuple(f"{mode}_{case}" for mode in FAILURE_ODC for case in (
    "kill_forward", "kill_backward", "kill_step", "kill_sum", "kill_gather", "stalled", "stalled_sum", "cut"))
#: micro-batches per rank (ranks 0-1 on node 0, 2-3 on node 1); a managed rank must run at least one
UNEVEN = {"uneven_unmanaged": (1, 3, 0, 2), "uneven_managed": (1, 3, 2, 1), "uneven_token": (2, 1, 3, 0)}
MASKED = ((0, 1), (2, 0))  # (rank, micro-batch) carrying no loss token
FROZEN_COUNTS = (2, 0, 1, 3)  # forwards per rank of a frozen engine (none on rank 1)
#: offload_states / reload_states across nodes: every state, then the accumulator alone with gradients pushed
OFFLOAD_CASE = {"counts": (1, 3, 2, 1), "bf16": True, "token": True, "mid_accumulation": True, "steps": 4,
                "odc": {"accumulator_dtype": "fp64"}, "calls": {1: None, 2: ["lp_grads"]}}


def cases(names, out_dir):
    import deepspeed
    import torch
    import torch.distributed as tdist

    from tests.support import (
        budget_workloads,
        checkpoint_workloads,
        contracts_across_nodes,
        deterministic_workloads,
        global_workloads,
        interleaving_workloads,
        offload_states_workloads,
        sync_workloads,
        workloads,
    )
    from tests.support.frozen_heap import freeze_imports

    torch.set_num_threads(1)
    freeze_imports()  # imports done: each case's engines collect only what they make
    counting = bool({"collectives", "global_collectives", "budget_collectives"} & set(names.split(",")))
    if counting:
        sync_workloads.install_collective_counter()  # before the process group, as the single-node test does
    deepspeed.init_distributed(dist_backend="gloo")
    rank = tdist.get_rank()
    for name in names.split(","):
        if name == "collectives":
            result = [sync_workloads.count_collectives("odc", layers, micro)
                      for layers, micro in ((1, 1), (2, 1), (1, 2))]
        elif name == "memory":
            result = memory_per_rank()
        elif name.startswith("ckpt_save:"):
            result = checkpoint_workloads.train_and_save(name.split(":", 1)[1])
        elif name.startswith("ckpt_load:"):
            _, ckpt_dir, tag = name.split(":")
            result = checkpoint_workloads.load_and_continue(ckpt_dir, tag)
        elif name == "crash_mid_save":
            killed_mid_save(out_dir)  # ends the process
        elif name == "kill":
            killed_on_node1(out_dir)  # ends the process
        elif name == "small_shm":
            result = initialize_outcome()
        elif name == "offload_states":
            result = offload_states_workloads.offload_round_trip(OFFLOAD_CASE)
        elif name == "deterministic":
            result = deterministic_workloads.train_twice(UNEVEN["uneven_token"], 3, "config", MASKED)
        elif name == "global_collectives":
            result = [sync_workloads.count_collectives("odc", layers, micro, odc=GLOBAL)
                      for layers, micro in ((1, 1), (2, 1), (1, 2))]
        elif name == "budget_collectives":
            result = sync_workloads.count_collectives("odc", 2, 2, odc=BUDGET)
        elif name == "budget_shape":
            result = budget_workloads.shape()
        elif name == "global_frozen":
            # ZeRO-3's frozen engine gathers in lockstep: every rank runs the most forwards there
            result = {"odc": global_workloads.frozen(FROZEN_COUNTS, "odc"),
                      "budget": global_workloads.frozen(FROZEN_COUNTS, "odc", FROZEN_BUDGET),
                      3: global_workloads.frozen((max(FROZEN_COUNTS),) * 4, 3)}
        elif name == "global_bitwise":
            result = {**global_workloads.bitwise(UNEVEN["uneven_unmanaged"]),
                      "budget": budget_workloads.bits(UNEVEN["uneven_unmanaged"])}
        elif name in FAILURE_CASES:
            failure_case(name, out_dir)  # ends the process
        elif name.startswith(("global_ckpt:", "budget_ckpt:")):  # saved and loaded back, in the same job
            ckpt_dir = name.split(":", 1)[1]
            options = GLOBAL if name.startswith("global") else BUDGET
            result = {"saved": checkpoint_workloads.train_and_save(ckpt_dir, odc=options),
                      "loaded": checkpoint_workloads.load_and_continue(ckpt_dir, "saved", universal=False,
                                                                       odc=options)}
        elif name == "global_delayed":
            result = global_workloads.delayed(UNEVEN["uneven_unmanaged"])
        elif name.startswith("interleavings:"):
            result = interleaving_workloads.across_nodes(name.split(":", 1)[1])
        elif name == "contracts":
            result = contracts_across_nodes.job_wide_calls()
        elif name in ("sp_across_nodes", "deferred_close"):
            result = getattr(global_workloads, name)()
        elif name in ("global_traffic", "global_memory", "global_refusals", "global_auto", "global_sp_refusal"):
            result = getattr(global_workloads, name[len("global_"):])()
        else:
            workload, args = CASES[name]
            result = getattr(workloads, workload)(*args())
        torch.save(result, os.path.join(out_dir, f"{name.split(':')[0]}_rank{rank}.pt"))
        print(f"two-hosts case {name} done on rank {rank}", flush=True)
    tdist.barrier()
    tdist.destroy_process_group()


def failure_case(name, out_dir):
    """Run the failure case ``name`` of :data:`FAILURE_CASES` (global_workloads.killed / stalled / cut with its
    mode's odc options); ends the process."""
    from tests.support import global_workloads

    mode, case = name.split("_", 1)
    odc = FAILURE_ODC[mode]
    if case.startswith("kill_"):
        global_workloads.killed(out_dir, 3, case[len("kill_"):], odc)
    elif case == "stalled_sum":
        global_workloads.stalled(out_dir, odc, "sum")
    else:
        getattr(global_workloads, case)(out_dir, odc)


def memory_per_rank():
    """What this rank really allocated: its windows (bytes of the transport's tensors) and its fp32
    optimizer state (master weights and Adam's moments), with the model's element counts."""
    import deepspeed
    import torch

    from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean

    engine, *_ = deepspeed.initialize(model=make_model(layers=3, hidden=64), config=ds_config("odc", bf16=True))
    x, y, _ = micro_batch(0, torch.distributed.get_rank(), 0)
    engine.backward(mse_mean(engine(x.to(torch.bfloat16)), y))
    engine.step()  # Adam's moments exist after the first step
    transport = engine.optimizer.odc.transport
    window, accumulator = transport.local_param_window(), transport.local_grad_accumulator()
    masters = engine.optimizer.fp32_partitioned_groups_flat
    state = sum(t.numel() * t.element_size() for s in engine.optimizer.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
    connections_before = _store_connections()
    engine.destroy()
    result = {"store_connections": (connections_before, _store_connections()),
              "window_bytes": window.numel() * window.element_size(),
              "accumulator_bytes": accumulator.numel() * accumulator.element_size(),
              "optimizer_bytes": sum(m.numel() * m.element_size() for m in masters) + state,
              "trainable": [p.ds_numel for p in engine.module.parameters() if p.requires_grad],
              "frozen": [p.ds_numel for p in engine.module.parameters() if not p.requires_grad],
              "world": torch.distributed.get_world_size(), "local_world": int(os.environ["LOCAL_WORLD_SIZE"])}
    return result


def _store_connections() -> int:
    """This process's TCP connections to the job's store (the process group's, and ODC's failure board's)."""
    import psutil

    port = int(os.environ["MASTER_PORT"])
    return sum(1 for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == port)


def initialize_outcome():
    """What ``deepspeed.initialize`` of an ODC engine does on this rank: ``{"error", "message", "host"}``
    (no error: the engine is destroyed again). The model's windows need ~100 KB per rank."""
    import deepspeed

    from tests.support.workloads import ds_config, make_model

    result = {"error": None, "message": "", "host": socket.gethostname()}
    try:
        engine, *_ = deepspeed.initialize(model=make_model(layers=3, hidden=64), config=ds_config("odc"))
        engine.destroy()
    except Exception as err:  # noqa: BLE001 - the error is the result
        result.update(error=type(err).__name__, message=str(err))
    result["shm"] = sorted(os.listdir(SHM))
    return result


def killed_mid_save(out_dir, victim=3):
    """A checkpoint saved whole (tag global_step2), a step, then a second save in which rank ``victim`` (node 1)
    dies (SIGKILL) while writing its optimizer shard, half of it written (checkpoint_workloads.save_then_crash_mid_save,
    the one-node test's workload). Every survivor reports how its save ended, how long it took and its node's
    /dev/shm after ``engine.destroy()``; the test then reads ``latest``. Ends the process once every survivor has
    reported (rank 0's holds the job's store)."""
    import torch.distributed as tdist

    from tests.support.checkpoint_workloads import save_then_crash_mid_save

    rank = tdist.get_rank()
    start = time.monotonic()
    outcome = save_then_crash_mid_save(os.path.join(out_dir, "ckpt"), victim)
    report = {"second_save": outcome["second_save"], "waited_s": time.monotonic() - start,
              "shm": sorted(os.listdir(SHM)), "host": socket.gethostname()}
    _write(os.path.join(out_dir, f"save_rank{rank}.json"), report)
    _wait_for([os.path.join(out_dir, f"save_rank{r}.json") for r in range(4) if r != victim], 60)
    os._exit(0)


def killed_on_node1(out_dir, victim=3):
    """Rank ``victim`` (on node 1) is killed in step 1's forward; every other rank reports the error its
    step raises, how long it waited, and its node's /dev/shm after ``engine.destroy()``, then exits
    without the process group's teardown (its peer is gone) once every survivor has reported."""
    import signal

    import deepspeed
    import torch.distributed as tdist

    from tests.support.workloads import _train_steps, ds_config, make_model, micro_batch, mse_mean

    rank = tdist.get_rank()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc", odc={"timeout_s": 60}))
    _train_steps(engine, 0, 1)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    x, y, _ = micro_batch(1, rank, 0)
    engine.backward(mse_mean(engine(x), y))
    start = time.monotonic()
    result = {"error": None}
    try:
        engine.step()
    except Exception as err:  # noqa: BLE001 - the error is the result
        result = {"error": type(err).__name__, "message": str(err), "waited_s": time.monotonic() - start}
    engine.destroy()
    result["shm"] = sorted(os.listdir(SHM))
    result["host"] = socket.gethostname()
    _write(os.path.join(out_dir, f"kill_rank{rank}.json"), result)
    # rank 0's process holds the job's store here: it stays until every survivor has its answer
    _wait_for([os.path.join(out_dir, f"kill_rank{r}.json") for r in range(4) if r != victim], 60)
    os._exit(0)


def ranks(node, local_world, world, master_addr, master_port, *argv):
    """Start this node's ranks with torch.distributed's environment (as a user's own launcher would), wait for
    them, and exit with the first non-zero status. The ranks are forked from this process once it has imported
    torch, DeepSpeed, ds_odc and the workloads (as the test harness's forkserver does, and before anything starts a
    thread): a fresh interpreter per rank spends seconds of CPU importing them, most of a short failure case. Each
    rank then runs ``argv`` as the script would and exits as a process running it would (an uncaught exception:
    its traceback and status 1)."""
    import deepspeed  # noqa: F401 - imported once, before the fork
    import torch  # noqa: F401

    import ds_odc  # noqa: F401
    from tests.support import global_workloads, workloads  # noqa: F401
    from tests.support.frozen_heap import freeze_imports

    freeze_imports()
    pids = []
    for local in range(int(local_world)):
        pid = os.fork()
        if pid == 0:  # the rank: never returns into this loop (SystemExit or an exception ends the process)
            os.environ.update(RANK=str(int(node) * int(local_world) + local), LOCAL_RANK=str(local),
                              WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR=master_addr,
                              MASTER_PORT=str(master_port))
            mode, *args = argv
            MODES[mode](*args)
            sys.exit(0)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print(f"two-hosts node {node} exit codes {codes}", flush=True)
    sys.exit(next((c for c in codes if c), 0))


MODES = {"isolation": isolation, "train": train, "cases": cases, "ranks": ranks}

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # the DeepSpeed launcher passes --local_rank=N first (LOCAL_RANK is in the environment too)
    mode, *args = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    MODES[mode](*args)
