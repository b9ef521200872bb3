"""ODC's ``cross_node`` modes ("replicate", "global"; "global-bf16": global with ``accumulator_dtype: "bf16"``;
"budget": the first half of the layers replicated per node, the rest global) and ZeRO-3, measured on two hosts
(2 nodes x 2 CPU ranks).

The two hosts are the test bed's (``tests/support/netns.py``): network, mount and UTS namespaces on this
machine joined by a veth pair, each host its own ``/dev/shm``. Every mode is one fresh ``torchrun --nnodes 2
--nproc_per_node 2`` job (one thread per rank) that trains the same model (``tests.support.workloads.Net``,
bf16, Adam) for warm-up + measured steps of 2 micro-batches each, and reports per rank:

* the median step time (both micro-batches' forward + backward, and the step), after a barrier per step;
* cross-node bytes per step: "global": ``engine.optimizer.odc.remote``'s ``bytes_read + bytes_pushed``
  over the measured steps, per step (measured); "replicate": the link's reduce-scatter of the accumulator's
  trainable blocks and all-gather of the window's, from the layout:
  ``(window element + accumulator element) * layout.trainable_numel * (nodes - 1)`` per step, and the
  link's collectives per step (counted); "budget": both, the remote bytes of the global layers (measured) plus
  the link's reduce-scatter and all-gather of the replicated ones, ``(window element + accumulator element) *
  replica_trainable * (nodes - 1)`` from the layout's replica slot; ZeRO-3: an estimate,
  ``3 * c * P * (W - 1) / W`` per micro-batch (two all-gathers and a reduce-scatter of a ring over all W ranks,
  c bytes per element), not measured;
* the bytes of the parameter window and gradient accumulator this rank allocated (ODC: the transport's
  ``local_param_window()`` / ``local_grad_accumulator()``; ZeRO-3: its parameter partitions, ``ds_tensor``, and
  its gradient partitions, ``grad_partitions_flat_buffer``);
* RSS after ``deepspeed.initialize`` (psutil) and peak RSS (``getrusage``'s ``ru_maxrss``).

    python benchmarks/cross_node_modes.py            # hidden 1024, 24 layers (~26M parameters), 2 + 3 steps
    python benchmarks/cross_node_modes.py --quick    # hidden 256, 4 layers, 1 + 2 steps

Needs root (namespaces). The machine's 2 cores are shared by the 4 ranks, so times are a loaded machine's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODES = ("replicate", "global", "global-bf16", "budget", "zero3")
#: each ODC mode's odc block
ODC_OPTIONS = {"replicate": {"cross_node": "replicate"}, "global": {"cross_node": "global"},
               "global-bf16": {"cross_node": "global", "accumulator_dtype": "bf16"}}
NODES, LOCAL = 2, 2
WORLD = NODES * LOCAL
MICRO_BATCHES = 2
#: "budget" replicates this share of the model's layers (the leading ones, as the planner takes them)
BUDGET_SHARE = 0.5


# -- on each rank (under torchrun) ----------------------------------------------------------------------
def rank_main(mode: str, out_dir: str, hidden: int, layers: int, warmup: int, steps: int) -> None:
    import resource

    import deepspeed
    import psutil
    import torch
    import torch.distributed as tdist

    from ds_odc.runtime.replica_layout import group_layers
    from tests.support.workloads import ds_config, make_model, micro_batch, mse_mean

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = tdist.get_rank()
    model = make_model(layers=layers, hidden=hidden)
    options: dict = {}
    if mode == "zero3":
        config = ds_config(3, gas=MICRO_BATCHES, bf16=True)
    else:
        options = budget_options(model) if mode == "budget" else ODC_OPTIONS[mode]
        config = ds_config("odc", gas=MICRO_BATCHES, bf16=True, odc=options)
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    rss_init = psutil.Process().memory_info().rss
    odc = None if mode == "zero3" else engine.optimizer.odc
    times, counters = [], []
    for step in range(warmup + steps):
        tdist.barrier()
        if step == warmup and odc is not None:
            counters.append(_counters(odc))
        start = time.perf_counter()
        for index in range(MICRO_BATCHES):
            x, y, _ = micro_batch(step, rank, index)
            engine.backward(mse_mean(engine(x.to(torch.bfloat16)), y))
            engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    if odc is not None:
        counters.append(_counters(odc))
    result = {"mode": mode, "rank": rank, "params": params, "trainable": trainable, "step_s": times,
              "rss_init": rss_init, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if odc is not None:
        transport = odc.transport
        window, accumulator = transport.local_param_window(), transport.local_grad_accumulator()
        result.update(window_bytes=window.numel() * window.element_size(),
                      accumulator_bytes=accumulator.numel() * accumulator.element_size(),
                      trainable_numel=odc.layout.trainable_numel, layout_nodes=odc.layout.node_count,
                      window_element=window.element_size(), accumulator_element=accumulator.element_size(),
                      counters=counters, cross_node=odc.cross_node.mode if odc.cross_node else mode)
        if mode == "budget":
            blocks = odc.layout.blocks
            result.update(replicated_layers=list(odc.cross_node.replicated_layers), layer_count=len(
                group_layers([(p.ds_id, name, p.ds_numel, p.requires_grad)
                              for name, p in engine.module.named_parameters()])[0]),
                replica_trainable=blocks.replica_trainable, budget_gb=options["node_replica_budget_gb"])
    else:
        partitions = [p.ds_tensor for p in engine.module.parameters()]
        gradients = engine.optimizer.grad_partitions_flat_buffer
        result.update(window_bytes=sum(t.numel() * t.element_size() for t in partitions),
                      accumulator_bytes=gradients.numel() * gradients.element_size(),
                      compute_element=partitions[0].element_size())
    engine.destroy()
    with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as out:
        json.dump(result, out)
    tdist.barrier()
    tdist.destroy_process_group()


def budget_options(model) -> dict:
    """The odc block of "budget": a ``node_replica_budget_gb`` that exactly pays for the leading
    ``BUDGET_SHARE`` of the model's layers (the planner's own grouping and cost, bf16 window, fp32 accumulator),
    so that the job replicates those and keeps the rest global whatever ``--layers`` and ``--hidden`` are."""
    from ds_odc.runtime.cross_node_plan import replicated_extra_bytes
    from ds_odc.runtime.replica_layout import group_layers

    named = [(key, name, p.numel(), p.requires_grad) for key, (name, p) in enumerate(model.named_parameters())]
    layers, _ = group_layers(named)
    wanted = layers[:max(1, round(len(layers) * BUDGET_SHARE))]
    cost = sum(replicated_extra_bytes(trainable, frozen, NODES, LOCAL) for _, trainable, frozen in wanted)
    return {"cross_node": "budget", "node_replica_budget_gb": cost * (1 + 1e-9) / 2 ** 30}


def _counters(odc) -> dict:
    remote = odc.remote
    return {"collectives": odc.link.collectives,
            "bytes_read": remote.bytes_read if remote is not None else 0,
            "bytes_pushed": remote.bytes_pushed if remote is not None else 0,
            "reads": remote.reads if remote is not None else 0,
            "pushes": remote.pushes if remote is not None else 0}


# -- what a rank's numbers mean --------------------------------------------------------------------------
def cross_node_bytes(result: dict, steps: int) -> tuple[float, str]:
    """Cross-node bytes per step of one rank, and how they were obtained."""
    if result["mode"].startswith("global"):
        return remote_bytes(result, steps), "measured"
    if result["mode"] == "budget":
        return remote_bytes(result, steps) + replica_link_bytes(result), "measured + layout"
    if result["mode"] == "replicate":
        per_element = result["window_element"] + result["accumulator_element"]
        return per_element * result["trainable_numel"] * (NODES - 1), "layout"
    c = result["compute_element"]
    return MICRO_BATCHES * 3 * c * result["params"] * (WORLD - 1) / WORLD, "estimate"


def remote_bytes(result: dict, steps: int) -> float:
    """Bytes per step this rank read from and pushed to owners on the other node (the remote transport's)."""
    return per_step(result, "bytes_read", steps) + per_step(result, "bytes_pushed", steps)


def replica_link_bytes(result: dict) -> float:
    """Bytes per step of budget's link: the replicated layers' accumulator slot reduce-scattered and their window
    slot all-gathered, once per other node (the layout's ``replica_trainable`` elements each)."""
    per_element = result["window_element"] + result["accumulator_element"]
    return per_element * result["replica_trainable"] * (NODES - 1)


def budget_line(results: dict) -> list:
    """Which layers "budget" replicated (the same on every rank), for the text above the table."""
    if "budget" not in results:
        return []
    first = results["budget"][0]
    layers = first["replicated_layers"]
    return [f"budget: `node_replica_budget_gb` {first['budget_gb']:.6f} ({first['budget_gb'] * 2 ** 30 / 2 ** 20:.1f}"
            f" MiB per rank beyond global), {len(layers)} of {first['layer_count']} layers replicated per node: "
            f"{', '.join(layers)}; the rest global.", ""]


def per_step(result: dict, key: str, steps: int) -> float:
    first, last = result["counters"]
    return (last[key] - first[key]) / steps


def markdown(results: dict, steps: int, hidden: int, layers: int, warmup: int) -> str:
    mib = 1024 * 1024
    any_rank = next(iter(results.values()))[0]
    lines = [f"Model: `make_model(layers={layers}, hidden={hidden})`, {any_rank['params'] / 1e6:.1f}M parameters "
             f"({any_rank['trainable'] / 1e6:.1f}M trainable), bf16, Adam; {MICRO_BATCHES} micro-batches of 4 "
             f"samples per step, {warmup} warm-up + {steps} measured steps; 2 nodes x 2 ranks.", "",
             *budget_line(results),
             "| mode | rank | median step (s) | cross-node MiB per step | how | window MiB | accumulator MiB "
             "| RSS after init (MiB) | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        for result in results.get(mode, []):
            moved, how = cross_node_bytes(result, steps)
            if mode.startswith("global") or mode == "budget":
                how += (f": read {per_step(result, 'bytes_read', steps) / mib:.1f} in "
                        f"{per_step(result, 'reads', steps):.0f} reads, pushed "
                        f"{per_step(result, 'bytes_pushed', steps) / mib:.1f} in "
                        f"{per_step(result, 'pushes', steps):.0f} pushes")
                if mode == "budget":
                    how += (f"; link {replica_link_bytes(result) / mib:.1f} "
                            f"({per_step(result, 'collectives', steps):.0f} link collectives/step)")
            elif mode == "replicate":
                how += f" ({per_step(result, 'collectives', steps):.0f} link collectives/step)"
            else:
                how += " (3cP(W-1)/W per micro-batch)"
            accumulator = f"{result['accumulator_bytes'] / mib:.1f}" + (" (grad partitions)" if mode == "zero3" else "")
            window = f"{result['window_bytes'] / mib:.1f}" + (" (param partitions)" if mode == "zero3" else "")
            lines.append(f"| {'ZeRO-3' if mode == 'zero3' else mode} | {result['rank']} | "
                         f"{statistics.median(result['step_s']):.3f} | {moved / mib:.1f} | {how} | {window} | "
                         f"{accumulator} | {result['rss_init'] / mib:.0f} | {result['peak_rss'] / mib:.0f} |")
    return "\n".join(lines)


# -- the driver ------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 1 warm-up + 2 measured steps")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mode's job")
    args = parser.parse_args(argv)
    from tests.support.netns import available, two_hosts

    if args.quick:
        args.hidden, args.layers, args.warmup, args.steps = 256, 4, 1, 2
    ok, reason = available()
    if not ok:
        raise SystemExit(f"cannot create two hosts here: {reason}")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    results = {}
    port = 29731
    with two_hosts(prefix="odcx") as hosts:
        out_dir = os.path.join(hosts.workdir, "out")
        os.makedirs(out_dir)
        os.chmod(out_dir, 0o777)
        for mode in args.modes.split(","):
            port += 1
            argvs = [[torchrun, "--nnodes", str(NODES), "--nproc_per_node", str(LOCAL), "--node_rank", str(i),
                      "--master_addr", hosts.master_addr, "--master_port", str(port), os.path.abspath(__file__),
                      "rank", mode, out_dir, str(args.hidden), str(args.layers), str(args.warmup), str(args.steps)]
                     for i in range(NODES)]
            started = time.monotonic()
            runs = hosts.run_on_both(argvs, timeout=args.timeout)
            if any(run.timed_out or run.returncode != 0 for run in runs):
                raise RuntimeError(f"{mode} failed:\n" + "\n".join(run.tail() for run in runs))
            results[mode] = []
            for rank in range(WORLD):
                with open(os.path.join(out_dir, f"{mode}_rank{rank}.json")) as f:
                    results[mode].append(json.load(f))
            print(f"{mode}: {time.monotonic() - started:.0f} s", flush=True)
    print(markdown(results, args.steps, args.hidden, args.layers, args.warmup))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:8]))
    else:
        main()
