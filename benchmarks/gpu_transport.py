"""Microbenchmark of the cuda_ipc transport: pull and push bandwidth against a plain copy of the
same bytes, and the slowdown of a GEMM on a GPU while a peer pulls from / pushes into it.

    python benchmarks/gpu_transport.py                      # 2 ranks, sizes 1..256 MiB
    python benchmarks/gpu_transport.py --world 2 --sizes-mib 64 256 --push-blocks 8 16 32 --markdown out.md
    python benchmarks/gpu_transport.py --json out.json      # the figures, for scripts/gpu_validate.py

Runs from a checkout (the repository root is put on ``sys.path``) or with ds_odc installed.

Ranks are spawned here (gloo for the start-up collectives only), rank r on GPU ``r % gpus``.
Rank 0 is the puller/pusher, rank 1 the owner. Columns:

* ``copy``: ``dst.copy_(src)`` of the same bytes on rank 0's GPU (device-to-device), and with two
  or more GPUs the in-process peer copy GPU 1 -> GPU 0 (what a pull is);
* ``pull``: ``transport.read`` of rank 1's parameter window (bf16) into a local buffer;
* ``push``: ``transport.accumulate`` of an fp32 / bf16 gradient into rank 1's fp32 accumulator;
  bytes counted as accumulator bytes (4 per element), compared with a copy of as many bytes;
* GEMM slowdown: median time of a bf16 GEMM on the owner's GPU (and on the pusher's own GPU, whose
  SMs the push kernel shares) while rank 0 keeps pulling / pushing, over the same GEMM alone.

Targets (docs/gpu.md): pull >= 90% and push >= 80% of copy bandwidth at >= 64 MiB; GEMM slowdown <= 3%.
Timings are host wall-clock around ``torch.cuda.synchronize()``, median of ``--iters`` repetitions.
With one GPU, the ranks share it: a pull is then a copy within one GPU's memory through an IPC mapping
(no NVLink), and the GEMM slowdown is not measured (the ranks would time-share the GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python benchmarks/gpu_transport.py` from a checkout puts only benchmarks/ there
    sys.path.insert(0, ROOT)

from ds_odc.runtime.vocabulary import RoundKind  # noqa: E402

MIB = 1 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (>= 2); rank r on GPU r %% gpus")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--push-blocks", type=int, nargs="+", default=[16],
                        help="CTAs one push may use (sweep to trade bandwidth against GEMM slowdown)")
    parser.add_argument("--gemm", type=int, default=8192, help="GEMM size n (n x n x n, bf16)")
    parser.add_argument("--gemm-seconds", type=float, default=3.0)
    parser.add_argument("--markdown", help="also append the tables to this file")
    parser.add_argument("--json", help="also write the figures to this file (JSON)")
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error("--world must be at least 2 (one rank pulls/pushes, another owns)")
    return args


def _timed(fn, iters):
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def _bandwidth_rows(transport, args, peer_gpu):
    import torch

    device = transport.device
    rows = []
    for size in args.sizes_mib:
        nbytes = size * MIB
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy = _gbps(nbytes, _timed(lambda dst=dst, src=src: dst.copy_(src), args.iters))
        peer_copy = None
        if peer_gpu is not None:
            remote = torch.empty(nbytes, dtype=torch.uint8, device=peer_gpu)
            peer_copy = _gbps(nbytes, _timed(lambda dst=dst, remote=remote: dst.copy_(remote), args.iters))
        out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        pull = _gbps(nbytes, _timed(lambda out=out: transport.read(1, 0, out), args.iters))
        numel = nbytes // 4
        grads = {"fp32": torch.randn(numel, device=device), "bf16": torch.randn(numel, device=device).bfloat16()}
        for blocks in args.push_blocks:
            transport.push_max_blocks = blocks
            push = {k: _gbps(nbytes, _timed(lambda g=g: transport.accumulate(1, 0, g), args.iters))
                    for k, g in grads.items()}
            rows.append((size, copy, peer_copy, pull, blocks, push["fp32"], push["bf16"]))
    return rows


def _gemm_median(seconds, n, device):
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    times, deadline = [], time.monotonic() + seconds
    torch.cuda.synchronize(device)
    while time.monotonic() < deadline:
        start = time.perf_counter()
        a @ b
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:] or times)


def _traffic(transport, kind, seconds, nbytes):
    """Keep pulling from / pushing into rank 1 for ``seconds`` (bounded queue: sync every 8)."""
    import torch

    device = transport.device
    out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    grad = torch.randn(nbytes // 4, device=device)
    deadline, issued = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        if kind == "pull":
            transport.read(1, 0, out)
        else:
            transport.accumulate(1, 0, grad)
        issued += 1
        if issued % 8 == 0:
            torch.cuda.synchronize(device)
    torch.cuda.synchronize(device)


def _gemm_rows(transport, args):
    """Median GEMM time on the owner's GPU (rank 1), alone and while rank 0 pulls from / pushes into it."""
    import torch

    rank, device = transport.rank, transport.device
    rows = []
    for kind in ("pull", "push"):
        alone = _gemm_median(args.gemm_seconds, args.gemm, device) if rank == 1 else 0.0
        transport.exchange(RoundKind.TEST, 0, torch.zeros(1), f"gemm baseline before {kind}")
        busy = 0.0
        if rank == 0:
            _traffic(transport, kind, args.gemm_seconds + 1.0, 64 * MIB)
        elif rank == 1:
            time.sleep(0.5)  # let the traffic start; it outlasts the measurement by 0.5 s
            busy = _gemm_median(args.gemm_seconds, args.gemm, device)
        both = transport.exchange(RoundKind.TEST, 0, torch.tensor([alone, busy]), f"gemm under {kind}")
        rows.append((kind, both[1, 0].item(), both[1, 1].item()))
    return rows


def _own_gemm_under_push(transport, args):
    """The pusher's own GEMM while its push kernels run beside it (SM sharing on one GPU)."""
    import threading

    import torch

    device = transport.device
    alone = _gemm_median(args.gemm_seconds, args.gemm, device)
    stop = threading.Event()

    def push_loop():
        torch.cuda.set_device(device)
        grad = torch.randn(64 * MIB // 4, device=device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            while not stop.is_set():
                transport.accumulate(1, 0, grad)
                stream.synchronize()

    worker = threading.Thread(target=push_loop, daemon=True)
    worker.start()
    time.sleep(0.5)
    busy = _gemm_median(args.gemm_seconds, args.gemm, device)
    stop.set()
    worker.join(timeout=60)
    torch.cuda.synchronize(device)
    return alone, busy


def _rank_main(rank, world, port, args, results):
    import torch
    import torch.distributed as tdist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(rank % gpus)
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    from ds_odc.comm import WindowSpec, create_transport

    transport = create_transport("cuda_ipc", rank=rank, world_size=world, timeout_s=120.0,
                                 device=f"cuda:{rank % gpus}")
    biggest = max(max(args.sizes_mib), 64) * MIB
    transport.allocate(WindowSpec(biggest // 2, torch.bfloat16, biggest // 4, exchange_width=8))
    try:
        peer_gpu = torch.device("cuda", 1 % gpus) if gpus > 1 else None
        bandwidth = _bandwidth_rows(transport, args, peer_gpu) if rank == 0 else None
        transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "bandwidth done")
        gemm = own = None
        if gpus > 1:
            gemm = _gemm_rows(transport, args)
            own = _own_gemm_under_push(transport, args) if rank == 0 else None
            transport.exchange(RoundKind.TEST, 0, torch.zeros(1), "gemm done")
        if rank == 0:
            results.put((bandwidth, gemm, own, torch.cuda.get_device_name(transport.device), gpus))
    finally:
        transport.close()
        tdist.destroy_process_group()


def _markdown(bandwidth, gemm, own, device_name, gpus, args, command):
    lines = [f"GPU transport microbenchmark on {gpus} x {device_name}, world {args.world}; command: `{command}`", "",
             "| MiB | copy GB/s | peer copy GB/s | pull GB/s | pull / copy | push CTAs | push fp32 GB/s "
             "| push bf16 GB/s | push / copy |", "|---|---|---|---|---|---|---|---|---|"]
    for size, copy, peer_copy, pull, blocks, push32, push16 in bandwidth:
        base = peer_copy or copy
        peer = f"{peer_copy:.1f}" if peer_copy else "n/a (one GPU)"
        lines.append(f"| {size} | {copy:.1f} | {peer} | {pull:.1f} | {pull / base:.2f} | {blocks} | {push32:.1f} "
                     f"| {push16:.1f} | {push32 / base:.2f} |")
    lines.append("")
    if gemm:
        lines += ["| traffic into the owner GPU | GEMM alone (ms) | GEMM under traffic (ms) | slowdown |",
                  "|---|---|---|---|"]
        for kind, alone, busy in gemm:
            lines.append(f"| {kind} | {alone * 1e3:.3f} | {busy * 1e3:.3f} | {100 * (busy / alone - 1):+.1f}% |")
        if own:
            alone, busy = own
            lines.append(f"| push kernels beside the pusher's own GEMM | {alone * 1e3:.3f} | {busy * 1e3:.3f} | "
                         f"{100 * (busy / alone - 1):+.1f}% |")
    else:
        lines.append("GEMM slowdown not measured: one GPU (ranks time-share it, so the number would mean nothing).")
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        sys.exit("benchmarks/gpu_transport.py needs torch")
    if not torch.cuda.is_available():
        reason = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        sys.exit(f"benchmarks/gpu_transport.py needs a CUDA GPU: {reason} (torch {torch.__version__}). "
                 "Nothing was measured.")
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(args.world, port, args, results), nprocs=args.world, start_method="spawn")
    bandwidth, gemm, own, device_name, gpus = results.get()
    command = "python benchmarks/gpu_transport.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = _markdown(bandwidth, gemm, own, device_name, gpus, args, command.strip())
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as out:
            out.write(table + "\n")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(_figures(bandwidth, gemm, own, device_name, gpus, args, command.strip()), out, indent=1)


def _figures(bandwidth, gemm, own, device_name, gpus, args, command):
    """The measurements as data: one row per (size, push CTAs); GEMM rows only with two or more GPUs."""
    rows = [{"mib": size, "copy_gbps": copy, "peer_copy_gbps": peer_copy, "pull_gbps": pull, "push_blocks": blocks,
             "push_fp32_gbps": push32, "push_bf16_gbps": push16}
            for size, copy, peer_copy, pull, blocks, push32, push16 in bandwidth]
    return {"command": command, "device": device_name, "gpus": gpus, "world": args.world, "rows": rows,
            "gemm": [{"traffic": kind, "alone_s": alone, "busy_s": busy} for kind, alone, busy in (gemm or [])],
            "own_gemm": {"alone_s": own[0], "busy_s": own[1]} if own else None}


if __name__ == "__main__":
    main()
