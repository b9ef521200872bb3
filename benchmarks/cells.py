"""Running one benchmark cell: ``world`` fresh spawned processes, results back through a queue.

Fresh processes per cell, so that each cell's peak memory and warm-up are its own. ``rank_main(rank,
port, cell, queue)`` must put ``(rank, result)`` (a dict; ``{"error": text}`` on failure) and be a
module-level function (spawn imports it by name).
"""
from __future__ import annotations

import socket
import time

import torch.multiprocessing as mp


def run_cell(rank_main, world: int, cell: dict, label: str, timeout_s: float) -> list[dict]:
    """Every rank's result, in rank order; raises naming the cell and rank on a failure or timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # not daemonic: a rank may start processes of its own (data-loader workers)
    procs = [ctx.Process(target=rank_main, args=(rank, port, cell, queue)) for rank in range(world)]
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
