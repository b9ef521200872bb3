"""What the ranks run in the cross-node exchange tests: 4 ranks of one host as 2 nodes of 2 (gloo).

The link sees nodes only through its cross-node group and the window layout's node blocks, so one host can
stand in for two here; test_two_hosts.py runs it between real hosts inside the engine."""
from __future__ import annotations

import time

import torch
import torch.distributed as tdist

from ds_odc.comm.cross_node import FailureBoard, TorchDistributedLink
from ds_odc.comm.failure import FailureKind, FailureRecord
from ds_odc.comm.nodes import job_store
from ds_odc.comm.topology import Topology
from ds_odc.runtime.layout import WindowLayout

NODES, LOCAL = 2, 2
TRAINABLE, FROZEN = (5, 3), (2,)  # shard sizes of the layout's parameters


def _exchange(timeout_s: float = 30.0, key: str = "exchange-test"):
    topology = Topology.from_launcher(NODES * LOCAL, LOCAL)
    rank = tdist.get_rank()
    cross = None
    for local_rank in range(LOCAL):  # every rank creates every group, in the same order
        group = tdist.new_group(list(topology.cross_group(local_rank)))
        if local_rank == topology.local_rank(rank):
            cross = group
    layout = WindowLayout(node_count=NODES)
    for key_, shard in enumerate(TRAINABLE):
        layout.add_trainable(key_, shard * NODES * LOCAL, shard)
    for key_, shard in enumerate(FROZEN, start=len(TRAINABLE)):
        layout.add_frozen(key_, shard * NODES * LOCAL, shard)
    beats = []
    exchange = TorchDistributedLink(cross, FailureBoard(job_store(timeout_s), f"ds_odc/{key}/failure"),
                                    timeout_s, rank, heartbeat=lambda: beats.append(1))
    return topology, layout, exchange, beats


def _values(rank: int, numel: int, salt: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * salt + rank), dtype=torch.float64)


def one_step() -> dict:
    """Accumulators of node partials, summed twice (more pushes after a first sum), windows gathered,
    counts and norms combined; returns what a single process can check."""
    topology, layout, exchange, _ = _exchange()
    rank = tdist.get_rank()
    node = topology.node_of(rank)
    accumulator = _values(rank, layout.accumulator_numel, 0)
    exchange.reduce_gradients(accumulator, layout.blocks)
    after_first = accumulator.clone()
    accumulator += _values(rank, layout.accumulator_numel, 1)  # pushes after a gradient read
    before = exchange.collectives
    exchange.reduce_gradients(accumulator, layout.blocks)
    window = torch.full((layout.window_numel,), -1.0, dtype=torch.bfloat16)
    window.narrow(0, *layout.trainable_block(node)).fill_(rank + 0.5)
    window.narrow(0, *layout.frozen_block(node)).fill_(-(rank + 0.5))
    exchange.gather_windows(window, layout.blocks, frozen=True)
    rows = exchange.job_rows(torch.tensor([[float(rank), 1.0]] * LOCAL, dtype=torch.float64))
    norm = exchange.job_sum(torch.tensor([float(node + 1)], dtype=torch.float64))
    return {"node": node, "local": topology.local_rank(rank), "after_first": after_first, "accumulator": accumulator,
            "window": window, "rows": rows, "norm": float(norm), "step_collectives": exchange.collectives - before}


#: how long after entering the exchange rank 2 posts rank 3's stall in the "stalled" case, beyond timeout_s
STALL_FOUND_AFTER_S = 0.5


def failure_reaches_the_other_node(how: str, timeout_s: float) -> dict:
    """Rank 3 fails (``how="posted"``: it posts a failure record, as a rank whose node lost a peer
    does), never joins (``"silent"``), or stalls (``"stalled"``: it never joins, and its node peer, rank 2,
    posts that it made no progress a little after ``timeout_s``, as a node's rounds find a stalled rank about
    when a cross-node partner's wait for it runs out); the others enter the exchange. Returns the error each
    gets and how long it waited. Rank 0's process holds the store: every rank stays until rank 1 is done."""
    _, layout, exchange, beats = _exchange(timeout_s, key=f"failure-{how}")
    rank = tdist.get_rank()
    hold_s = 5.0 if how == "posted" else 2 * timeout_s + 3
    if rank == 3:
        if how == "posted":
            exchange.announce(FailureRecord(3, 7, "the step fence", "RuntimeError: injected"))
        time.sleep(hold_s)  # never joins
        return {"rank": rank}
    start = time.monotonic()
    try:
        exchange.reduce_gradients(torch.zeros(layout.accumulator_numel, dtype=torch.float64), layout.blocks)
        result = {"rank": rank, "error": None}
    except Exception as err:  # noqa: BLE001 - the error is the result
        result = {"rank": rank, "error": type(err).__name__, "message": str(err), "waited_s": time.monotonic() - start,
                  "origin": getattr(getattr(err, "record", None), "origin", None), "heartbeats": len(beats)}
    if rank == 2 and how == "stalled":
        time.sleep(max(0.0, start + timeout_s + STALL_FOUND_AFTER_S - time.monotonic()))
        exchange.announce(FailureRecord(3, 7, "waiting at a rendezvous round of step 7",
                                        f"made no progress for {timeout_s:.0f}s", FailureKind.STALLED))
    if rank != 1:  # ranks 0 and 2 meet each other (or see the board): rank 1 waits for rank 3
        time.sleep(hold_s)
    return result
