"""Running one benchmark cell: ``world`` fresh spawned processes, results back through a queue.

Fresh processes per cell, so that each cell's peak memory and warm-up are its own. A smoke run, which measures
nothing, may fork its ranks from a forkserver that imported the heavy modules once (``preload``) instead.
``run(rank, cell)`` returns the rank's result (a dict) and must be a module-level function (spawn imports it by name).

Where a cell computes (:func:`accelerator_of`): a cell whose ``"device"`` is a CUDA device gets DeepSpeed's
CUDA accelerator and torch's default threads; every other cell the CPU accelerator and one thread (the CPU
benchmarks' ranks share a small machine). Forcing the CPU on every cell made a ``--device cuda`` benchmark
train on one CPU thread and record a peak GPU memory of 0.
"""
from __future__ import annotations

import os
import socket
import time

import torch
import torch.multiprocessing as mp


def accelerator_of(cell: dict) -> str:
    """"cuda" for a cell whose ``"device"`` names a CUDA device, else "cpu"."""
    return "cuda" if str(cell.get("device", "cpu")).split(":")[0] == "cuda" else "cpu"


def _rank_main(run, rank, world, port, cell, queue):
    accelerator = accelerator_of(cell)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR=accelerator)
    if accelerator == "cpu":
        torch.set_num_threads(1)
    try:
        queue.put((rank, run(rank, cell)))
    except BaseException as error:  # report, never hang the parent
        import traceback
        queue.put((rank, {"error": f"{error!r}\n{traceback.format_exc()}"}))
        raise


def run_cell(run, world: int, cell: dict, label: str, timeout_s: float, preload=None) -> list[dict]:
    """Every rank's result, in rank order; raises naming the cell and rank on a failure or timeout. ``preload``
    (smoke runs only: the ranks' memory and warm-up are then not their own): the modules a forkserver imports once
    for every cell of this process, whose ranks it forks."""
    if preload:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(preload))
    else:
        ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # not daemonic: a rank may start processes of its own (data-loader workers)
    procs = [ctx.Process(target=_rank_main, args=(run, rank, world, port, cell, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(results) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"cell {label} did not finish in {timeout_s} s")
            rank, result = queue.get(timeout=remaining)
            if "error" in result:
                raise RuntimeError(f"cell {label}, rank {rank} failed:\n{result['error']}")
            results[rank] = result
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world)]
