"""What the ranks run in the cross-node exchange tests: 4 ranks as 2 nodes of 2 (one host, gloo)."""
from __future__ import annotations

import torch
import torch.distributed as tdist

from ds_odc.runtime.exchange import CrossNodeExchange
from ds_odc.runtime.topology import Topology

NODES, LOCAL = 2, 2


def _groups():
    topology = Topology.from_launcher(NODES * LOCAL, LOCAL)
    rank = tdist.get_rank()
    cross = None
    for local_rank in range(LOCAL):  # every rank creates every group, in the same order
        group = tdist.new_group(list(topology.cross_group(local_rank)))
        if local_rank == topology.local_rank(rank):
            cross = group
    return topology, cross


def one_step(numel: int, steps: int = 1) -> dict:
    """Each rank holds a node-local accumulator shard (its node's sum for that shard) of ``numel``
    elements; the step sums it over nodes, updates this rank's slice (SGD on an fp32 master slice) and
    gathers the bf16 result into the window shard. Returns what a single process can check."""
    topology, cross = _groups()
    rank = tdist.get_rank()
    exchange = CrossNodeExchange(cross)
    local = topology.local_rank(rank)
    window = torch.zeros(numel, dtype=torch.bfloat16)
    start, stop = exchange.slice_bounds(numel)
    master = torch.zeros(stop - start, dtype=torch.float32)
    per_step = []
    for step in range(steps):
        before = exchange.collectives
        accumulator = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank))
        tokens = torch.tensor([float(10 + rank)], dtype=torch.float64)
        total_tokens = exchange.summarise(tokens)
        summed = exchange.reduce_scatter(accumulator)
        master -= 0.1 * summed / total_tokens.to(torch.float32)
        exchange.all_gather(master, window)
        per_step.append(exchange.collectives - before)
    return {"local": local, "node": topology.node_of(rank), "bounds": (start, stop), "window": window,
            "total_tokens": float(total_tokens), "collectives_per_step": per_step}
