"""How one push (scatter-accumulate) is split over the kernel's threads: pure math, testable on CPU.

The kernel (``ops/csrc/odc_kernels.cu``) adds ``numel`` source elements into an accumulator
through a peer mapping. Remote memory is reached most efficiently with 16-byte vector reductions,
which need a 16-byte aligned destination, but a parameter's shard starts at any element offset.
So the range is split into

* a **head** of up to 3 elements, added one by one, until the destination is 16-byte aligned
  (fp32 accumulator; an fp64 accumulator has no vector reduction and no head);
* a **body** of ``groups`` groups of 4 elements, one vector reduction each (sm_90+; 4 scalar
  reductions on older GPUs), the source read with one vector load when it is aligned too;
* a **tail** of up to 3 elements, added one by one.

Worked example: fp32 accumulator at byte address 1000 (= 8 mod 16), 11 bf16 source elements at 2000::

    head 2   (addresses 1000, 1004; the body starts at 1008, 16-byte aligned)
    groups 2 (elements 2..9), tail 1 (element 10)
    vector_loads: source element 2 sits at 2004, not 8-byte aligned -> False (scalar loads)

How the body is walked (why: a push must run at memory bandwidth, so each thread keeps ``UNROLL``
loads in flight before it issues their reductions): a block takes a *tile* of ``UNROLL * threads``
groups, thread ``t`` the groups ``t, t + threads, ..., t + (UNROLL - 1) * threads`` of it (each load
coalesced across the warp), and blocks stride over tiles. The head and tail ("edges", at most 6
elements) are added by the first threads of block 0.

``blocks`` here is what the work needs (one per tile), bounded by ``max_blocks`` when one is given.
The kernel bounds it again by one wave of the device it runs on (multiprocessors x 2 blocks, read
off the device at its first launch; ``odc_kernels.cu``), so by default a push is sized from the
device; a smaller ``max_blocks`` (the transport's ``push_max_blocks``) leaves SMs to backward's kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

VECTOR = 4  # elements per group
UNROLL = 4  # groups per thread per tile: must equal kUnroll in ops/csrc/odc_kernels.cu (a test reads it)
DEFAULT_THREADS = 256
DEFAULT_MAX_BLOCKS: Optional[int] = None  # None: one wave of the device (the kernel reads it off the device)


@dataclass(frozen=True)
class PushPlan:
    numel: int
    head: int
    groups: int
    vector_loads: bool
    blocks: int
    threads: int

    @property
    def tail(self) -> int:
        return self.numel - self.head - VECTOR * self.groups

    @property
    def edges(self) -> int:
        return self.head + self.tail

    @property
    def tile_groups(self) -> int:
        return UNROLL * self.threads


def push_plan(dst_address: int, src_address: int, numel: int, acc_itemsize: int, src_itemsize: int, *,
              threads: int = DEFAULT_THREADS, max_blocks: Optional[int] = DEFAULT_MAX_BLOCKS) -> PushPlan:
    """Split a push of ``numel`` elements (byte addresses of destination and source).

    >>> push_plan(1000, 2000, 11, 4, 2)
    PushPlan(numel=11, head=2, groups=2, vector_loads=False, blocks=1, threads=256)
    >>> push_plan(1024, 2048, 1 << 20, 4, 4).blocks       # 262,144 groups, 1,024 per tile
    256
    >>> push_plan(1024, 2048, 1 << 20, 4, 4, max_blocks=8).blocks
    8
    """
    if acc_itemsize not in (4, 8):
        raise ValueError(f"accumulator element size must be 4 (fp32) or 8 (fp64), got {acc_itemsize}")
    if src_itemsize not in (2, 4):
        raise ValueError(f"gradient element size must be 2 (bf16/fp16) or 4 (fp32), got {src_itemsize}")
    if dst_address % acc_itemsize or src_address % src_itemsize:
        raise ValueError(f"addresses must be element-aligned (destination {dst_address}, source {src_address})")
    if numel < 0 or threads < 32 or threads > 1024 or (max_blocks is not None and max_blocks < 1):
        raise ValueError(f"bad push: numel {numel}, threads {threads}, max_blocks {max_blocks}")
    if acc_itemsize == 4:
        head = min(numel, ((16 - dst_address % 16) % 16) // 4)
    else:
        head = 0
    groups = (numel - head) // VECTOR
    vector_loads = groups > 0 and (src_address + head * src_itemsize) % (VECTOR * src_itemsize) == 0
    tiles = -(-groups // (UNROLL * threads))
    blocks = max(1, tiles if max_blocks is None else min(max_blocks, tiles))
    return PushPlan(numel, head, groups, vector_loads, blocks, threads)


def element_visits(plan: PushPlan, blocks: Optional[int] = None) -> torch.Tensor:
    """How many times the kernel's index mapping touches each element (must be exactly once).

    Replays the kernel's loops on the CPU (tiles strided over ``blocks`` blocks, ``UNROLL`` groups per
    thread per tile, the edges by the first threads), so the mapping is testable without a GPU.
    ``blocks``: the grid the kernel really launched (the device's wave may cut the plan's); default
    the plan's."""
    blocks = plan.blocks if blocks is None else blocks
    visits = torch.zeros(plan.numel, dtype=torch.int64)
    tile = plan.tile_groups
    tiles = -(-plan.groups // tile)
    # thread t's k-th group of a tile: k * threads + t (the kernel's `first + k * blockDim.x`)
    within = (torch.arange(UNROLL)[:, None] * plan.threads + torch.arange(plan.threads)[None, :]).flatten()
    for block in range(blocks):
        for first in range(block * tile, tiles * tile, blocks * tile):
            group = first + within
            group = group[group < plan.groups]
            for k in range(VECTOR):
                visits.index_add_(0, plan.head + VECTOR * group + k, torch.ones_like(group))
    thread = torch.arange(min(plan.edges, blocks * plan.threads))
    index = torch.where(thread < plan.head, thread, plan.head + VECTOR * plan.groups + (thread - plan.head))
    visits.index_add_(0, index, torch.ones_like(index))
    return visits
