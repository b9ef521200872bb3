"""What runs on the two "hosts" of test_two_hosts.py (see netns.py), as a script:

``python two_host_workloads.py isolation OUT_DIR``
    Reports this host's hostname and /dev/shm, creates a file there, waits (bounded) until both
    hosts have, lists /dev/shm again, then waits for the test's ``release`` file so that the test
    can look at the root namespace's /dev/shm while both files exist.

``python two_host_workloads.py train STAGE OUT_DIR`` (under torchrun or the DeepSpeed launcher)
    ``deepspeed.init_distributed("gloo")``, an all_reduce of the rank ids, then a few steps of a
    tiny model under DeepSpeed with ``"zero_optimization": {"stage": STAGE}``; writes
    ``OUT_DIR/hello<rank>.json`` after the all_reduce and ``OUT_DIR/rank<rank>.json`` at the end.
    An error in ``deepspeed.initialize`` is written to ``OUT_DIR/error<rank>.json`` and then
    propagates: the rank exits non-zero with its traceback on stderr.
"""
import json
import os
import socket
import sys
import time

SHM = "/dev/shm"
STEPS = 3


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


def train(stage, out_dir):
    import deepspeed
    import torch
    import torch.distributed as tdist

    from tests.distributed.workloads import ds_config, make_model, micro_batch, mse_mean

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = tdist.get_rank(), tdist.get_world_size()
    ids = torch.tensor([float(rank)])
    tdist.all_reduce(ids)
    hello = {"rank": rank, "world": world, "host": socket.gethostname(), "local_rank": os.environ.get("LOCAL_RANK"),
             "env_world_size": os.environ.get("WORLD_SIZE"), "rank_sum": ids.item(), "shm": sorted(os.listdir(SHM))}
    _write(os.path.join(out_dir, f"hello{rank}.json"), hello)
    print(f"two-hosts hello {json.dumps(hello)}", flush=True)

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
    result = {**hello, "engine": type(engine).__name__, "losses": losses, "mean_losses": mean_losses,
              "eval_losses": eval_losses}
    _write(os.path.join(out_dir, f"rank{rank}.json"), result)
    print(f"two-hosts done {json.dumps(result)}", flush=True)
    engine.destroy()
    tdist.barrier()
    tdist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    # the DeepSpeed launcher passes --local_rank=N first (LOCAL_RANK is in the environment too)
    mode, *args = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    {"isolation": isolation, "train": train}[mode](*args)
