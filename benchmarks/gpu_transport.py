"""Microbenchmark of the cuda_ipc transport: push against a local add of the same elements, pull against a
copy of the same bytes, and the slowdown of a GEMM on a GPU while a peer pulls from / pushes into it.

    python benchmarks/gpu_transport.py                      # 2 ranks, sizes 1..256 MiB
    python benchmarks/gpu_transport.py --world 2 --sizes-mib 64 256 --push-blocks auto 132 66 --markdown out.md
    python benchmarks/gpu_transport.py --json out.json      # the figures, for scripts/gpu_validate.py

Runs from a checkout (the repository root is put on ``sys.path``) or with ds_odc installed.

Ranks are spawned here (gloo for the start-up collectives only), rank r on GPU ``r % gpus``.
Rank 0 is the puller/pusher, rank 1 the owner. What is compared with what:

* **push** (``transport.accumulate`` of an fp32 / bf16 gradient into rank 1's fp32 accumulator) against
  a **local add** ``acc.add_(grad)`` of the same elements on rank 0's GPU: both read the gradient and read
  and write the accumulator, so they move the same bytes. (A copy moves two thirds of them: push/copy could
  never pass a target of 80%.) Swept over ``--push-blocks`` (``auto``: one wave of the device, the
  kernel's default; numbers: at most that many blocks);
* **pull** (``transport.read`` of rank 1's bf16 window) against a **copy of the same bytes from the peer
  GPU** (``dst.copy_(remote)``), with two or more GPUs. With one GPU a pull *is* a device-to-device copy
  within the GPU, so the ratio means nothing there: the figures carry the copy for reference and
  scripts/gpu_validate.py reports the pull ratio as not measurable;
* GEMM slowdown (two or more GPUs): median time of a bf16 GEMM on the owner's GPU (and on the pusher's own
  GPU, whose SMs the push kernel shares) while rank 0 keeps pulling / pushing, over the same GEMM alone.

Targets (docs/gpu.md): push >= 80% of a local add, pull >= 90% of a peer copy at >= 64 MiB; GEMM
slowdown <= 3%. Times are CUDA events around each call on the caller's stream (a pull makes that stream
wait for its pull stream, so the event after it marks the pull's end), median of ``--iters``.
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

MIB = 1 << 20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (>= 2); rank r on GPU r %% gpus")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--push-blocks", nargs="+", default=["auto"],
                        help="at most this many blocks per push ('auto': one wave of the device, the default): "
                             "sweep to trade bandwidth against GEMM slowdown")
    parser.add_argument("--gemm", type=int, default=8192, help="GEMM size n (n x n x n, bf16)")
    parser.add_argument("--gemm-seconds", type=float, default=3.0)
    parser.add_argument("--markdown", help="also append the tables to this file")
    parser.add_argument("--json", help="also write the figures to this file (JSON)")
    args = parser.parse_args(argv)
    if args.world < 2:
        parser.error("--world must be at least 2 (one rank pulls/pushes, another owns)")
    try:
        args.push_blocks = [None if b == "auto" else int(b) for b in args.push_blocks]
    except ValueError:
        parser.error(f"--push-blocks takes 'auto' or block counts, got {args.push_blocks}")
    return args


def _timed(fn, iters):
    """Median seconds of ``fn`` between two CUDA events on the current stream (one warm-up call first)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def _bandwidth_rows(transport, args, peer_gpu):
    """One row per (size, push block bound): copy, peer copy, pull, local adds and pushes (seconds)."""
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
            del remote
        del src
        out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        pull = _gbps(nbytes, _timed(lambda out=out: transport.read(1, 0, out), args.iters))
        del out, dst
        numel = nbytes // 4  # accumulator elements: the accumulator is `size` MiB of fp32
        grads = {"fp32": torch.randn(numel, device=device), "bf16": torch.randn(numel, device=device).bfloat16()}
        acc = torch.zeros(numel, device=device)
        add = {k: _timed(lambda g=g, acc=acc: acc.add_(g), args.iters) for k, g in grads.items()}
        del acc
        for blocks in args.push_blocks:
            transport.push_max_blocks = blocks
            push = {k: _timed(lambda g=g: transport.accumulate(1, 0, g), args.iters) for k, g in grads.items()}
            rows.append({"mib": size, "copy_gbps": copy, "peer_copy_gbps": peer_copy, "pull_gbps": pull,
                         "push_blocks": "auto" if blocks is None else blocks, "push_fp32_s": push["fp32"],
                         "push_bf16_s": push["bf16"], "add_fp32_s": add["fp32"], "add_bf16_s": add["bf16"],
                         "push_fp32_gbps": _gbps(3 * nbytes, push["fp32"]),
                         "add_fp32_gbps": _gbps(3 * nbytes, add["fp32"])})
        del grads
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

    from ds_odc.runtime.round_kinds import RoundKind

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

    from ds_odc.runtime.round_kinds import RoundKind

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
             "Push vs a local `acc.add_(grad)` of the same elements (both move 3 x the fp32 accumulator bytes: "
             "GB/s counts those); pull vs a copy of the same bytes from the peer GPU (with one GPU a pull is a "
             "device-to-device copy: no ratio).", "",
             "| MiB | copy GB/s | peer copy GB/s | pull GB/s | pull / peer copy | push blocks | add fp32 GB/s "
             "| push fp32 GB/s | push / add fp32 | push / add bf16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in bandwidth:
        peer = row["peer_copy_gbps"]
        peer_text = f"{peer:.1f}" if peer else "n/a (one GPU)"
        pull_ratio = f"{row['pull_gbps'] / peer:.2f}" if peer else "not measurable"
        lines.append(f"| {row['mib']} | {row['copy_gbps']:.1f} | {peer_text} | {row['pull_gbps']:.1f} | {pull_ratio} "
                     f"| {row['push_blocks']} | {row['add_fp32_gbps']:.1f} | {row['push_fp32_gbps']:.1f} "
                     f"| {row['add_fp32_s'] / row['push_fp32_s']:.2f} | {row['add_bf16_s'] / row['push_bf16_s']:.2f} |")
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
    """The measurements as data: one row per (size, push block bound); GEMM rows only with two or more GPUs."""
    return {"command": command, "device": device_name, "gpus": gpus, "world": args.world, "rows": bandwidth,
            "gemm": [{"traffic": kind, "alone_s": alone, "busy_s": busy} for kind, alone, busy in (gemm or [])],
            "own_gemm": {"alone_s": own[0], "busy_s": own[1]} if own else None}


if __name__ == "__main__":
    main()
