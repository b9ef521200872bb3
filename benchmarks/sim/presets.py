"""Machines and workloads to simulate: the paper's golden setting, and one measured on this machine.

Golden setting (the paper's Table 1): DeepSeek-R1-Distill-Qwen-1.5B, LongAlign lengths (max 64K),
4 samples per rank, 8 ranks, token cap 64K (packing ratio 1). Everything below that is not in the
paper is an assumption, named as such:

- compute: the paper's fitted cost ``a·x² + b·x`` (a=1.982122, b=2.611821, x = s/32000) read as
  **seconds of forward+backward on one A100**. Check: at s = 32K the linear term is 2.61 s, and a
  1.5B model with activation recomputation does ≈ 8·1.5e9·32000 ≈ 3.8e14 FLOP, i.e. ≈ 147 TFLOP/s,
  about half of an A100's bf16 peak, which is what packed long-sequence training reaches.
- model: 28 decoder layers of ≈ 47M parameters; gathers move bf16 (94 MB per layer), gradient
  reduces and pushes move fp32 (188 MB per layer), as the reference trains.
- links: inside a node (up to 8 ranks, NVSwitch) collectives and point-to-point both reach
  130 GB/s per rank (the paper finds them comparable inside a node); across nodes (800 Gb/s RoCE
  per node) collectives reach 80 GB/s per rank and point-to-point 4x less, 20 GB/s (the paper
  reports 3-6x less). Latencies 30 µs (collective) and 15 µs (point-to-point) per transfer.
- fixed costs: the optimizer updates a 1/D shard of 1.5B fp32 parameters with AdamW (≈ 28 bytes
  of memory traffic per parameter at 1.5 TB/s); ODC's fence is two barriers plus publishing the
  bf16 shard at the same memory speed.
- lengths: LongAlign itself is not available offline, so lengths are drawn from a lognormal clipped
  to [256, 65536] with σ = 0.7 (so about 1% of samples hit the 64K cap) and μ solved so that the
  clipped mean is 16,540 tokens, LongAlign's mean. This is an assumption, not the paper's data.

>>> hw = golden_preset(8)
>>> hw.layers, round(hw.gather_seconds * 1e3, 3), round(hw.reduce_seconds * 1e3, 3)  # ms per layer
(28, 0.663, 1.295)
>>> golden_preset(16).pull_seconds > 5 * golden_preset(8).pull_seconds  # 16 ranks span two nodes
True
"""
from __future__ import annotations

import dataclasses
import math
import random

from benchmarks.sim.hardware import Hardware, Link, spread_over_peers
from ds_odc.balance import CostModel
from ds_odc.errors import ODCError

GOLDEN_COST_MODEL = CostModel.quadratic_linear(1.982122, 2.611821, length_unit=32000)
"""The paper's fitted cost of one 1.5B sample, in (assumed) A100 seconds."""
GOLDEN_TOKEN_CAP = 65536
GOLDEN_SAMPLES_PER_RANK = 4
GOLDEN_WORLD_SIZE = 8
LONGALIGN_MEAN_TOKENS = 16540

_PARAMS_PER_LAYER = 47e6
_MODEL_PARAMS = 1.5e9
_LAYERS = 28
_RANKS_PER_NODE = 8
_INTRA_NODE_COLLECTIVE = Link(bandwidth=130e9, latency=30e-6)
_INTRA_NODE_P2P = Link(bandwidth=130e9, latency=15e-6)
_INTER_NODE_COLLECTIVE = Link(bandwidth=80e9, latency=30e-6)
_INTER_NODE_P2P = Link(bandwidth=20e9, latency=15e-6)
_HBM_BYTES_PER_SECOND = 1.5e12
_ADAMW_BYTES_PER_PARAM = 28


#: Links between nodes, per rank: name -> (collective, point-to-point). The first is the golden setting's.
INTER_NODE_LINKS = {
    "RoCE 800 Gb/s per node (golden)": (_INTER_NODE_COLLECTIVE, _INTER_NODE_P2P),
    "IB 400 Gb/s per GPU": (Link(bandwidth=50e9, latency=30e-6), Link(bandwidth=12.5e9, latency=15e-6)),
    "100 Gb/s per GPU": (Link(bandwidth=12.5e9, latency=30e-6), Link(bandwidth=3.1e9, latency=15e-6)),
}


def golden_preset(world_size: int = GOLDEN_WORLD_SIZE, prefetch_depth: int = 1,
                  inter_node: tuple[Link, Link] = (_INTER_NODE_COLLECTIVE, _INTER_NODE_P2P)) -> Hardware:
    """The 1.5B model on A100s, ``world_size`` ranks, 8 per node (see the module docstring); across
    nodes, ``inter_node`` = (collective link, point-to-point link) per rank. ODC here is the paper's
    design: every pull and push goes to its owner, across nodes too."""
    if world_size < 1:
        raise ODCError(f"golden_preset: world_size must be >= 1, got {world_size}")
    one_node = world_size <= _RANKS_PER_NODE
    collective = _INTRA_NODE_COLLECTIVE if one_node else inter_node[0]
    p2p = _INTRA_NODE_P2P if one_node else inter_node[1]
    gather_bytes, reduce_bytes = 2 * _PARAMS_PER_LAYER, 4 * _PARAMS_PER_LAYER
    shard = _MODEL_PARAMS / world_size
    optimizer = shard * _ADAMW_BYTES_PER_PARAM / _HBM_BYTES_PER_SECOND
    fence = 2 * (p2p.latency if world_size > 1 else 0.0) + 2 * shard / _HBM_BYTES_PER_SECOND
    return Hardware(
        layers=_LAYERS,
        gather_seconds=spread_over_peers(collective, gather_bytes, world_size),
        reduce_seconds=spread_over_peers(collective, reduce_bytes, world_size),
        pull_seconds=spread_over_peers(p2p, gather_bytes, world_size),
        push_seconds=spread_over_peers(p2p, reduce_bytes, world_size),
        prefetch_depth=prefetch_depth,
        optimizer_seconds=optimizer,
        fence_seconds=fence,
        description=f"golden: 1.5B, {world_size} A100 ranks ({'one node' if one_node else 'multi-node'})")


def hierarchical_preset(world_size: int, prefetch_depth: int = 1,
                        inter_node: tuple[Link, Link] = (_INTER_NODE_COLLECTIVE, _INTER_NODE_P2P)) -> Hardware:
    """:func:`golden_preset`, with ODC as this engine runs it across nodes (docs/multinode.md): pulls
    and pushes stay inside the node (its 8 ranks hold every shard between them), and the step adds
    one exchange between nodes on the collective link: a reduce-scatter of each rank's fp32
    accumulator (``4·P/8`` bytes) and an all-gather of its bf16 window (``2·P/8``) over the ranks with
    its local rank, plus two small all-reduces. The collective engine's numbers are golden's.

    >>> flat, tiered = golden_preset(16), hierarchical_preset(16)
    >>> tiered.pull_seconds == golden_preset(8).pull_seconds, tiered.gather_seconds == flat.gather_seconds
    (True, True)
    >>> round(tiered.fence_seconds - flat.fence_seconds, 3)  # the exchange, seconds per step
    0.007
    """
    flat = golden_preset(world_size, prefetch_depth, inter_node)
    local = min(world_size, _RANKS_PER_NODE)
    nodes = math.ceil(world_size / local)
    if nodes == 1:
        return flat
    block = _MODEL_PARAMS / local  # parameters of a rank's windows: its cross-node group's shards
    collective = inter_node[0]
    exchange = (spread_over_peers(collective, 4 * block, nodes) + spread_over_peers(collective, 2 * block, nodes)
                + 2 * collective.latency)
    return dataclasses.replace(
        flat, pull_seconds=spread_over_peers(_INTRA_NODE_P2P, 2 * _PARAMS_PER_LAYER, local),
        push_seconds=spread_over_peers(_INTRA_NODE_P2P, 4 * _PARAMS_PER_LAYER, local),
        fence_seconds=flat.fence_seconds + exchange,
        description=f"golden, {world_size} ranks on {nodes} nodes, ODC inside each node, one exchange per step")


MEASURED_COMM_KEYS = {
    "layers": "layers the model's parameters are gathered in (default 1)",
    "prefetch_depth": "layers gathered ahead of compute (default 0: on CPU transfers run on the compute thread)",
    "gather_per_micro_batch": "seconds of one collective all-gather pass over all parameters",
    "reduce_per_micro_batch": "seconds of one reduce-scatter pass over all gradients",
    "pull_per_micro_batch": "seconds of one ODC pull pass over all parameters",
    "push_per_micro_batch": "seconds of one ODC push pass over all gradients",
    "collective_micro_batch_overhead": "fixed seconds per micro-batch of the collective engine",
    "odc_micro_batch_overhead": "fixed seconds per micro-batch of ODC",
    "optimizer": "seconds of the optimizer step (both engines)",
    "fence": "extra seconds of ODC's step (fence, normalise, publish)",
}


def measured_preset(cost_model: CostModel, comm: dict | None = None) -> Hardware:
    """A machine described by what was measured on it: a cost model fitted in seconds (so one cost
    unit is one second) and the communication constants in ``comm`` (keys: :data:`MEASURED_COMM_KEYS`,
    all optional, absent = free). Per-micro-batch passes are split evenly over ``layers``; forward
    and backward each do one gather pass."""
    if not isinstance(cost_model, CostModel):
        raise ODCError(f"measured_preset: cost_model must be a CostModel, got {type(cost_model).__name__}")
    comm = dict(comm or {})
    unknown = sorted(set(comm) - set(MEASURED_COMM_KEYS))
    if unknown:
        raise ODCError(f"measured_preset: unknown comm keys {unknown}; known: {sorted(MEASURED_COMM_KEYS)}")
    layers = comm.pop("layers", 1)
    prefetch = comm.pop("prefetch_depth", 0)
    for key, value in comm.items():
        if not isinstance(value, (int, float)) or not value >= 0:
            raise ODCError(f"measured_preset: comm[{key!r}] must be a number of seconds >= 0, got {value!r}")
    if not isinstance(layers, int) or layers < 1:
        raise ODCError(f"measured_preset: comm['layers'] must be an int >= 1, got {layers!r}")
    return Hardware(
        layers=layers,
        gather_seconds=comm.get("gather_per_micro_batch", 0.0) / layers,
        reduce_seconds=comm.get("reduce_per_micro_batch", 0.0) / layers,
        pull_seconds=comm.get("pull_per_micro_batch", 0.0) / layers,
        push_seconds=comm.get("push_per_micro_batch", 0.0) / layers,
        prefetch_depth=prefetch,
        collective_micro_batch_seconds=comm.get("collective_micro_batch_overhead", 0.0),
        odc_micro_batch_seconds=comm.get("odc_micro_batch_overhead", 0.0),
        optimizer_seconds=comm.get("optimizer", 0.0),
        fence_seconds=comm.get("fence", 0.0),
        description="measured on this machine")


def longalign_like_lengths(count: int, seed: int, mean: float = LONGALIGN_MEAN_TOKENS,
                           cap: int = GOLDEN_TOKEN_CAP, sigma: float = 0.7, minimum: int = 256) -> list[int]:
    """``count`` sample lengths from a lognormal clipped to ``[minimum, cap]`` whose clipped mean is
    ``mean`` (an assumption standing in for LongAlign; see the module docstring). Deterministic."""
    if count < 0:
        raise ODCError(f"longalign_like_lengths: count must be >= 0, got {count}")
    if not 0 < minimum < mean < cap:
        raise ODCError(f"longalign_like_lengths: need 0 < minimum ({minimum}) < mean ({mean}) < cap ({cap})")
    if not sigma > 0:
        raise ODCError(f"longalign_like_lengths: sigma must be > 0, got {sigma}")
    mu = _lognormal_location_for_clipped_mean(mean, cap, sigma)
    rng = random.Random(seed)
    return [min(cap, max(minimum, int(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def _lognormal_location_for_clipped_mean(mean: float, cap: float, sigma: float) -> float:
    """μ such that E[min(X, cap)] = mean for X ~ LogNormal(μ, σ) (bisection; the lower clip is tiny)."""

    def clipped_mean(mu: float) -> float:
        phi = lambda z: 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))  # noqa: E731
        log_cap = math.log(cap)
        return (math.exp(mu + sigma * sigma / 2) * phi((log_cap - mu - sigma * sigma) / sigma)
                + cap * (1.0 - phi((log_cap - mu) / sigma)))

    low, high = math.log(mean) - 10 * sigma, math.log(cap)
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if clipped_mean(middle) < mean else (low, middle)
    return (low + high) / 2
