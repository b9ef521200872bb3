"""Between nodes, one exchange per step (the multi-node plan, ``docs/multinode.md``; not yet used by the engine).

Inside a node, ODC shards the windows and the fp32 gradient accumulators over the node's ranks. The
ranks that hold the same node-local shard on every node (a ``cross_group``, one rank per node) then
share that shard's step:

1. :meth:`CrossNodeExchange.summarise`: one all-reduce on the world group of a few numbers every rank
   contributes (micro-batch and token counts, squared-norm partials, failure and overflow flags);
2. :meth:`CrossNodeExchange.reduce_scatter`: the accumulator shard summed over the nodes, each rank
   keeping its ``1/n_nodes`` slice (so ``1/world`` of every parameter: where its fp32 master weights
   and optimizer state live);
3. the caller updates its slice;
4. :meth:`CrossNodeExchange.all_gather`: every rank's updated slice, in the compute dtype, back into
   the node-local shard.

Three collectives per step, whatever the number of layers, parameters and micro-batches, all on
``torch.distributed`` (gloo on CPU, NCCL on GPU). A shard whose size does not divide by the number of
nodes is padded with zeros at its end; the padding never reaches a caller.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist


class CrossNodeExchange:
    """The step's collectives between nodes, for one rank (``cross_group``: the ranks holding the same
    node-local shard, one per node, in node order)."""

    def __init__(self, cross_group, world_group=None):
        self.cross_group, self.world_group = cross_group, world_group
        self.nodes = tdist.get_world_size(cross_group)
        self.node = tdist.get_rank(cross_group)
        self.collectives = 0  # issued so far: a test counts them per step

    def slice_bounds(self, numel: int) -> tuple[int, int]:
        """This rank's slice of a node-local shard of ``numel`` elements (the last slices may be short)."""
        chunk = -(-numel // self.nodes)
        start = min(numel, self.node * chunk)
        return start, min(numel, start + chunk)

    def summarise(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over every rank of the world of a small vector (counts, norm partials, flags)."""
        total = values.clone()
        tdist.all_reduce(total, group=self.world_group)
        self.collectives += 1
        return total

    def reduce_scatter(self, shard: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``shard`` (1-D) summed over the nodes."""
        chunk = -(-shard.numel() // self.nodes)
        padded = torch.zeros(chunk * self.nodes, dtype=shard.dtype, device=shard.device)
        padded[:shard.numel()] = shard
        out = torch.empty(chunk, dtype=shard.dtype, device=shard.device)
        tdist.reduce_scatter_tensor(out, padded, group=self.cross_group)
        self.collectives += 1
        start, stop = self.slice_bounds(shard.numel())
        return out[:stop - start]

    def all_gather(self, updated: torch.Tensor, shard: torch.Tensor) -> None:
        """Write every node's updated slice (``updated``: this rank's, any dtype) into ``shard`` (1-D,
        the node-local shard in its own dtype, e.g. the window)."""
        chunk = -(-shard.numel() // self.nodes)
        mine = torch.zeros(chunk, dtype=shard.dtype, device=shard.device)
        mine[:updated.numel()] = updated.to(shard.dtype)
        gathered = torch.empty(chunk * self.nodes, dtype=shard.dtype, device=shard.device)
        tdist.all_gather_into_tensor(gathered, mine, group=self.cross_group)
        self.collectives += 1
        shard.copy_(gathered[:shard.numel()])
