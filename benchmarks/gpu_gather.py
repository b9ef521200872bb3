"""Batched against per-piece transfers for one gather of ~70 parameters, on the cuda_ipc transport.

    python benchmarks/gpu_gather.py                    # 2 ranks, gathers shaped like a small and a larger LM
    python benchmarks/gpu_gather.py --json out.json    # the figures, for scripts/gpu_validate.py

ZeRO-3 gathers a module's parameters (or a prefetch bucket of several modules) in one call. ODC pulls
every owner's shard of each parameter with one ``read_many`` (today one ``cudaMemcpyAsync`` per owner per
parameter, queued together, one event) and pushes each gradient slice into its owner's accumulator (one
push kernel per piece). The open question (docs/gpu.md, item 5) is whether one launch per gather (a
batched memcpy, a multi-range kernel) is worth writing. This measures, for one gather of ``8 x 9``
parameter tensors shaped like a Llama layer stack (q, k, v, o, gate, up, down and two norms per layer),
partitioned over ``--world`` ranks:

* pull, per piece: one ``transport.read`` per owner per parameter (each orders the caller's stream
  after it) against batched: one ``read_many`` and its ``wait()``;
* push, per piece: one ``transport.accumulate`` (bf16 gradient into the fp32 accumulator) per owner per
  parameter against one ``accumulate_many``;
* for each: the device time from the first launch to the last completion (CUDA events on the caller's
  stream), and the host time spent issuing the launches, medians over ``--iters`` gathers.

Rank 0 transfers; the other ranks own shards and wait. With one GPU every rank is on it.
``--transport shm`` runs the same on CPU ranks (host times only): a dry run of this script without a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

LAYER = ("q", "k", "v", "o", "gate", "up", "down", "norm1", "norm2")


def layer_shapes(hidden: int, layers: int) -> list:
    """Element counts of the gather's parameters: ``9 * layers`` tensors."""
    ffn = 11 * hidden // 4
    sizes = {"q": hidden * hidden, "k": hidden * hidden, "v": hidden * hidden, "o": hidden * hidden,
             "gate": hidden * ffn, "up": hidden * ffn, "down": ffn * hidden, "norm1": hidden, "norm2": hidden}
    return [sizes[name] for _ in range(layers) for name in LAYER]


def _pieces(shapes, world):
    """(owner, offset in the owner's window, numel, offset in the full tensor, tensor index) of every piece."""
    pieces, window_offset = [], 0
    for index, numel in enumerate(shapes):
        shard = -(-numel // world)
        for owner in range(world):
            count = max(0, min(shard, numel - owner * shard))
            if count:
                pieces.append((owner, window_offset, count, owner * shard, index))
        window_offset += shard
    return pieces, window_offset


def _median_times(run, iters, device):
    """(device ms, host issue ms): medians over ``iters`` runs after two warm-ups (on CPU both are host
    times: the work is done when the call returns)."""
    import torch

    cuda = device.type == "cuda"
    device_ms, host_ms = [], []
    for i in range(iters + 2):
        if cuda:
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        begin = time.perf_counter()
        run()
        issued = time.perf_counter()
        if cuda:
            end.record()
            end.synchronize()
        if i >= 2:
            device_ms.append(start.elapsed_time(end) if cuda else (issued - begin) * 1e3)
            host_ms.append((issued - begin) * 1e3)
    return statistics.median(device_ms), statistics.median(host_ms)


def _measure(transport, device, shapes, iters):
    import torch

    from ds_odc.comm.batch import Transfer

    world = transport.world_size
    pieces, _ = _pieces(shapes, world)
    fulls = [torch.empty(numel, dtype=torch.bfloat16, device=device) for numel in shapes]
    grads = [torch.randn(numel).bfloat16().to(device) for numel in shapes]
    reads = [Transfer(owner, offset, fulls[index].narrow(0, start, count))
             for owner, offset, count, start, index in pieces]
    pushes = [Transfer(owner, offset, grads[index].narrow(0, start, count))
              for owner, offset, count, start, index in pieces]

    def pull_each():
        for t in reads:
            transport.read(t.owner, t.offset, t.tensor)

    def pull_batched():
        transport.read_many(reads).wait()

    def push_each():
        for t in pushes:
            transport.accumulate(t.owner, t.offset, t.tensor)

    def push_batched():
        transport.accumulate_many(pushes).wait()

    figures = {"tensors": len(shapes), "pieces": len(pieces), "mib": sum(shapes) * 2 / 2**20}
    for kind, each, batched in (("pull", pull_each, pull_batched), ("push", push_each, push_batched)):
        each_ms, each_host = _median_times(each, iters, device)
        batch_ms, batch_host = _median_times(batched, iters, device)
        figures[kind] = {"per_piece_ms": each_ms, "per_piece_issue_ms": each_host, "batched_ms": batch_ms,
                         "batched_issue_ms": batch_host}
    return figures


def rank_main(hiddens, layers, iters, name="cuda_ipc"):
    """In a rank (tests/support/harness.py: process group up, CUDA accelerator): allocate windows large
    enough for the largest gather, rank 0 measures, then every rank meets before closing."""
    import torch
    import torch.distributed as tdist

    from ds_odc.comm import WindowSpec, create_transport
    from ds_odc.runtime.round_kinds import RoundKind
    from tests.support.transports import CASES

    rank, world = tdist.get_rank(), tdist.get_world_size()
    device = CASES[name].device()
    numel = max(_pieces(layer_shapes(h, layers), world)[1] for h in hiddens)
    transport = create_transport(name, rank=rank, world_size=world, timeout_s=300.0, device=str(device))
    transport.allocate(WindowSpec(numel, torch.bfloat16, numel, exchange_width=8))
    try:
        results = [dict(hidden=h, **_measure(transport, device, layer_shapes(h, layers), iters)) for h in hiddens] \
            if rank == 0 else None
        transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "gather benchmark done")
        cuda = device.type == "cuda"
        return {"device": torch.cuda.get_device_name(device) if cuda else "CPU", "transport": name,
                "gpus": torch.cuda.device_count() if cuda else 0, "shapes": results}
    finally:
        transport.close()


def markdown(figures, command) -> str:
    lines = [f"Batched vs per-piece transfers ({figures['transport']}), {figures['world']} ranks on "
             f"{figures['gpus']} x {figures['device']}; command: `{command}`", "",
             "| hidden | tensors | pieces | MiB | kind | per piece: device ms | issue ms "
             "| batched: device ms | issue ms "
             "| per piece / batched |", "|---|---|---|---|---|---|---|---|---|---|"]
    for shape in figures["shapes"]:
        for kind in ("pull", "push"):
            f = shape[kind]
            lines.append(f"| {shape['hidden']} | {shape['tensors']} | {shape['pieces']} | {shape['mib']:.1f} | {kind} "
                         f"| {f['per_piece_ms']:.3f} | {f['per_piece_issue_ms']:.3f} | {f['batched_ms']:.3f} "
                         f"| {f['batched_issue_ms']:.3f} | {f['per_piece_ms'] / f['batched_ms']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--transport", default="cuda_ipc", choices=["cuda_ipc", "shm"])
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    from benchmarks import gpu_gather  # the rank function travels by name: not from __main__
    from tests.support.harness import run_ranks
    from tests.support.transports import CASES, rank_env

    if not CASES[args.transport].usable():
        sys.exit(f"benchmarks/gpu_gather.py: {CASES[args.transport].why_not}; nothing was measured")
    results = run_ranks(gpu_gather.rank_main, args.world, args.hidden, args.layers, args.iters, args.transport,
                        env=rank_env(args.transport, args.world), timeout=args.timeout)
    figures = {"world": args.world, **results[0]}
    command = "python benchmarks/gpu_gather.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(markdown(figures, command.strip()))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": command.strip(), **figures}, out, indent=1)


if __name__ == "__main__":
    main()
