"""Across nodes, per ``zero_optimization.odc.cross_node`` mode: model-state memory per GPU, cross-node bytes per
GPU, and time, for Llama-3 8B and 70B on 1-8 nodes of 8 GPUs. Arithmetic, not a measurement.

    .venv/bin/python benchmarks/multinode_projection.py                  # all tables (a few seconds)
    .venv/bin/python benchmarks/multinode_projection.py --no-simulator   # closed forms only

1. Memory: ZeRO-3 (bf16 gradient partition, and fp32), replicate (today), global with fp32 and bf16
   accumulators, and what ``cross_node: "auto"`` picks under a ``node_replica_budget_gb``
   (ds_odc/runtime/cross_node_plan.py computes every figure).
2. Cross-node bytes per GPU per micro-batch and per step, by mode.
3. Closed-form time per micro-batch of T tokens at a 50 GB/s NIC per GPU and 400 TFLOP/s achieved: compute
   6·P·T/F against each mode's NIC seconds, and T*, the tokens per micro-batch above which global sharding's
   traffic hides behind compute.
4. A whole step through the step simulator (benchmarks/sim/timeline.py, the one sim_projection.py uses):
   M micro-batches per GPU with long-tailed (clipped lognormal) lengths, mean 4K and 16K tokens, layer by layer,
   ZeRO-3 as a collective engine (waits at every layer), the cross_node modes as ODC (one meeting per step).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.sim.hardware import Hardware

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

#: name -> (parameters, decoder layers): Llama-3's counts (8.03e9 and 70.6e9 to three figures).
MODELS = {"8B": (8_030_261_248, 32), "70B": (70_553_706_496, 80)}
RANKS_PER_NODE = 8
NODES = (1, 2, 4, 8)
NIC = 50e9  # bytes/s per GPU across nodes (400 Gb/s InfiniBand per GPU)
NVLINK = 130e9  # bytes/s per GPU inside a node (the simulator's golden preset)
LATENCY = 30e-6  # seconds per transfer
FLOPS = 400e12  # achieved per GPU
BUDGET_GB = 8.0  # node_replica_budget_gb of the "auto" rows
C, A = 2, 4  # bf16 window and pushes, fp32 accumulator (today's defaults)
DATE = "2026-11-28"


def memory_rows(params: int, layers: int) -> list[tuple[str, str, list[str]]]:
    """(label, formula, GiB per GPU at each of NODES)."""
    from ds_odc.runtime.cross_node_plan import GIB, ModelStates

    def cells(states_of) -> list[str]:
        return [f"{states_of(ModelStates(params, params, RANKS_PER_NODE, n)).total / GIB:.1f}" for n in NODES]

    rows = [("ZeRO-3 (bf16 gradient partition, default)", "16P/W", cells(lambda s: s.zero3())),
            ("ZeRO-3, `grad_accum_dtype` fp32", "18P/W", cells(lambda s: s.zero3(gradient_bytes=4))),
            ("replicate (today)", "6P/R + 12P/W", cells(lambda s: s.replicate())),
            ("global, fp32 accumulators", "18P/W", cells(lambda s: s.global_sharded())),
            ("global, bf16 accumulators", "16P/W",
             cells(lambda s: dataclasses.replace(s, accumulator_bytes=2).global_sharded()))]
    auto = []
    for n in NODES:
        choice = auto_choice(params, layers, n)
        auto.append(f"{choice.bytes_per_rank / GIB:.1f} ({choice.mode}, {len(choice.replicated_layers)}/{layers})")
    rows.append((f"auto, `node_replica_budget_gb: {BUDGET_GB:g}` (mode, layers replicated)",
                 "18P/W + (N−1)/W·6·P_repl", auto))
    return rows


def equal_layers(params: int, layers: int) -> list[tuple[str, int, int]]:
    """The model as ``layers`` equal trainable layers (embeddings and norms folded in)."""
    return [(f"layers.{i}", params // layers + (1 if i < params % layers else 0), 0) for i in range(layers)]


def auto_choice(params: int, layers: int, nodes: int):
    from ds_odc.runtime.cross_node_plan import resolve_cross_node

    return resolve_cross_node("auto", BUDGET_GB, equal_layers(params, layers), nodes, RANKS_PER_NODE)


def replicated_fraction(params: int, layers: int, nodes: int) -> float:
    choice = auto_choice(params, layers, nodes)
    return len(choice.replicated_layers) / layers


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Cross-node bytes per GPU NIC: per micro-batch, and once per step."""

    per_micro_batch: float
    per_step: float


def traffic(mode: str, params: float, nodes: int, fraction: float = 0.0) -> Traffic:
    """ZeRO-3: ring collectives put about S/R of an S-byte collective on each GPU's NIC (bf16 gathers in forward
    and backward, bf16 reduce-scatter: 6P/R per micro-batch). replicate: the step's reduce-scatter of the fp32
    accumulator and all-gather of the bf16 window over the cross group, (a + c)·P·(N−1)/W. global: bf16 pulls in
    forward and backward and a bf16 push, each for the (N−1)/N of the shards on other nodes: 3c·P·(N−1)/N.
    budget: ``fraction`` of the parameters replicated, the rest global."""
    if nodes == 1:
        return Traffic(0.0, 0.0)
    world = RANKS_PER_NODE * nodes
    if mode == "zero3":
        return Traffic(3 * C * params / RANKS_PER_NODE, 0.0)
    if mode == "replicate":
        return Traffic(0.0, (A + C) * params * (nodes - 1) / world)
    if mode == "global":
        return Traffic(3 * C * params * (nodes - 1) / nodes, 0.0)
    if mode == "budget":
        replicated, shared = traffic("replicate", params, nodes), traffic("global", params, nodes)
        return Traffic((1 - fraction) * shared.per_micro_batch, fraction * replicated.per_step)
    raise ValueError(mode)


def threshold_tokens(mode: str, nodes: int, fraction: float = 0.0) -> float:
    """T*: tokens per micro-batch at which 6·P·T/F equals the mode's per-micro-batch NIC seconds (model size
    cancels). 0 where nothing crosses nodes per micro-batch."""
    per_param = traffic(mode, 1.0, nodes, fraction).per_micro_batch  # bytes per parameter per micro-batch
    return per_param * FLOPS / (6 * NIC)


def memory_section() -> list[str]:
    lines = ["### Model states per GPU (GiB)", "",
             f"8 GPUs per node, W = 8·N; P = Llama-3's parameter count; Adam (12 bytes of optimizer state per "
             f"parameter), bf16 compute; no activations, gathered layers or padding. The auto rows split P over equal "
             f"decoder layers and replicate, in forward order, the layers whose extra fits {BUDGET_GB:g} GiB per GPU "
             "(`resolve_cross_node`).", ""]
    for name, (params, layers) in MODELS.items():
        lines += [f"{name} (P = {params:,}, {layers} layers):", "",
                  "| mode | per GPU | " + " | ".join(f"N={n}" for n in NODES) + " |",
                  "|---|---|" + "---|" * len(NODES)]
        lines += [f"| {label} | {formula} | " + " | ".join(cells) + " |"
                  for label, formula, cells in memory_rows(params, layers)]
        lines.append("")
    return lines


def traffic_section() -> list[str]:
    nodes = [n for n in NODES if n > 1]
    lines = ["### Cross-node bytes per GPU (GB)", "",
             "Per micro-batch / per step (the step part once, whatever the micro-batch count). ZeRO-3: ring "
             "collectives, ≈ S/R of an S-byte collective on each NIC; global: flat point-to-point, (N−1)/N of a "
             "layer from other nodes; the two accumulator dtypes move the same bytes (pushes carry bf16). budget: "
             "the auto choice above, fraction f of the parameters replicated.", ""]
    for name, (params, layers) in MODELS.items():
        lines += [f"{name}:", "", "| mode | per micro-batch | per step | " + " | ".join(f"N={n}" for n in nodes)
                  + " |", "|---|---|---|" + "---|" * len(nodes)]
        for mode, per_mb, per_step in (("zero3", "≈6P/R", "–"), ("replicate", "0", "6P(N−1)/W"),
                                       ("global", "6P(N−1)/N", "≈0"), ("budget", "6(1−f)P(N−1)/N", "6fP(N−1)/W")):
            cells = []
            for n in nodes:
                f = replicated_fraction(params, layers, n) if mode == "budget" else 0.0
                t = traffic(mode, params, n, f)
                cells.append(f"{t.per_micro_batch / 1e9:.1f} / {t.per_step / 1e9:.1f}"
                             + (f" (f={f:.2f})" if mode == "budget" else ""))
            label = {"zero3": "ZeRO-3", "budget": f"auto, budget {BUDGET_GB:g} GiB"}.get(mode, mode)
            lines.append(f"| {label} | {per_mb} | {per_step} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def time_section(tokens=(4096, 16384)) -> list[str]:
    nodes = [n for n in NODES if n > 1]
    lines = ["### Time, closed form", "",
             f"NIC {NIC / 1e9:g} GB/s per GPU, {FLOPS / 1e12:g} TFLOP/s achieved, compute 6·P·T/F per micro-batch of T "
             "tokens. ZeRO-3's traffic overlaps compute (a barrier at every layer); global's overlaps it too (no "
             "barriers); replicate's runs once per step, not overlapped. T* = tokens per micro-batch above which a "
             "mode's per-micro-batch traffic hides behind compute: (F/B)·(bytes per parameter per micro-batch)/6, "
             "independent of model size.", ""]
    for name, (params, layers) in MODELS.items():
        compute = "; ".join(f"{6 * params * t / FLOPS:.2f} s at T={t // 1024}K" for t in tokens)
        lines += [f"{name}: compute per micro-batch {compute}.", "",
                  "| | " + " | ".join(f"N={n}" for n in nodes) + " |", "|---|" + "---|" * len(nodes)]
        rows = [("ZeRO-3 NIC s per micro-batch (overlapped)",
                 [f"{traffic('zero3', params, n).per_micro_batch / NIC:.2f}" for n in nodes]),
                ("global NIC s per micro-batch (overlapped)",
                 [f"{traffic('global', params, n).per_micro_batch / NIC:.2f}" for n in nodes]),
                ("replicate s per step (not overlapped)",
                 [f"{traffic('replicate', params, n).per_step / NIC:.2f}" for n in nodes])]
        fractions = [replicated_fraction(params, layers, n) for n in nodes]
        rows.append((f"auto {BUDGET_GB:g} GiB: NIC s per micro-batch / per step",
                     [f"{traffic('budget', params, n, f).per_micro_batch / NIC:.2f} / "
                      f"{traffic('budget', params, n, f).per_step / NIC:.2f}" for n, f in zip(nodes, fractions)]))
        rows += [("T* ZeRO-3 (tokens)", [f"{threshold_tokens('zero3', n):,.0f}" for n in nodes]),
                 ("T* global (tokens)", [f"{threshold_tokens('global', n):,.0f}" for n in nodes]),
                 (f"T* auto {BUDGET_GB:g} GiB (tokens)",
                  [f"{threshold_tokens('budget', n, f):,.0f}" for n, f in zip(nodes, fractions)])]
        lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
        lines.append("")
    return lines


def _transfer(nic_bytes: float, node_bytes: float) -> float:
    """Seconds of a transfer whose cross-node and in-node parts run side by side on their own links."""
    if nic_bytes <= 0 and node_bytes <= 0:
        return 0.0
    return LATENCY + max(nic_bytes / NIC, node_bytes / NVLINK)


def step_hardware(mode: str, params: int, layers: int, nodes: int, fraction: float = 0.0) -> Hardware:
    """Per-layer seconds of each mode for the step simulator (prefetch one layer ahead; optimizer not counted:
    it is the same 1/W update in every mode)."""
    from benchmarks.sim.hardware import Hardware

    r, world, layer = RANKS_PER_NODE, RANKS_PER_NODE * nodes, params / layers
    compute = dict(layers=layers, prefetch_depth=1, seconds_per_cost_unit=6 * params / FLOPS)
    if mode == "zero3":  # all-gather / reduce-scatter over W ranks: S/R on the NIC, the rest over NVLink
        move = _transfer(C * layer / r if nodes > 1 else 0.0, C * layer * (r - 1) / r)
        return Hardware(gather_seconds=move, reduce_seconds=move, **compute)
    local = _transfer(0.0, C * layer * (r - 1) / r)  # every shard in the node
    remote = _transfer(C * layer * (nodes - 1) / nodes, C * layer * (r - 1) / world)
    exchange = traffic("replicate", params, nodes).per_step / NIC + (2 * LATENCY if nodes > 1 else 0.0)
    share = {"replicate": 1.0, "global": 0.0, "budget": fraction}[mode]
    move = share * local + (1 - share) * remote  # layers of equal size: the mean per-layer transfer
    return Hardware(pull_seconds=move, push_seconds=move, fence_seconds=share * exchange, **compute)


def step_section(micro_batches: int, steps: int, seed: int, means=(4096, 16384), cap: int = 65536,
                 model: str = "70B") -> list[str]:
    from benchmarks.sim.presets import longalign_like_lengths
    from benchmarks.sim.timeline import simulate_step
    from ds_odc.balance import CostModel, Plan

    params, layers = MODELS[model]
    lines = ["### A whole step, simulated", "",
             f"{model}, step simulator (`benchmarks/sim/timeline.py`), layer by layer: {micro_batches} micro-batches "
             f"per GPU, one sequence each, lengths from a clipped lognormal (σ 0.7, 256 to {cap // 1024}K tokens) of "
             f"the given mean, the same sequences for every mode (no balancer); {steps} sampled step(s) per cell. "
             "Compute 6·P·T/F split evenly over the layers (backward twice forward); transfers per layer on one "
             f"channel per GPU, one layer ahead; in-node {NVLINK / 1e9:g} GB/s, cross-node {NIC / 1e9:g} GB/s per "
             f"GPU, {LATENCY * 1e6:g} µs per transfer. ZeRO-3 runs as a collective engine (every GPU waits for the "
             "slowest at every layer); the cross_node modes as ODC (pulls and pushes per GPU, one meeting per "
             f"step, replicate's exchange after it). auto = `node_replica_budget_gb: {BUDGET_GB:g}`, its replicated "
             "layers' transfers taken as in-node and the rest as global (the per-layer mean). Seconds per step; in "
             "brackets, over the same engine's step with free communication (the balance bound: ZeRO-3's "
             "includes waiting for the slowest GPU of each micro-batch, ODC's only for the slowest GPU of the step), "
             "so a bracket is what communication costs. Not modelled: owners serving many pullers at once, "
             "attention's quadratic term, the optimizer (the same 1/W update in every mode).", "",
             "| mean tokens | N | ZeRO-3 | replicate | global | auto | ODC bound | ZeRO-3 bound |",
             "|---|---|---|---|---|---|---|---|"]
    for mean in means:
        for nodes in [n for n in NODES if n > 1]:
            world = RANKS_PER_NODE * nodes
            fraction = replicated_fraction(params, layers, nodes)
            hardware = {mode: step_hardware(mode, params, layers, nodes, fraction)
                        for mode in ("zero3", "replicate", "global", "budget")}
            scale = hardware["zero3"].seconds_per_cost_unit
            totals = dict.fromkeys(list(hardware) + ["odc bound", "zero3 bound"], 0.0)
            for step in range(steps):
                lengths = tuple(longalign_like_lengths(world * micro_batches, seed=seed * 100003 + step, mean=mean,
                                                       cap=cap))
                batches = tuple(tuple((rank * micro_batches + m,) for m in range(micro_batches))
                                for rank in range(world))
                plan = Plan("fixed", lengths, cap, CostModel.tokens(), batches)
                for mode, hw in hardware.items():
                    totals[mode] += simulate_step(plan, hw, "collective" if mode == "zero3" else "odc").step_seconds
                totals["odc bound"] += plan.odc_step_cost() * scale  # = the simulator without communication
                totals["zero3 bound"] += plan.collective_step_cost() * scale

            cells = [_over_bound(totals, "zero3", "zero3 bound", steps)] + [
                _over_bound(totals, m, "odc bound", steps) for m in ("replicate", "global", "budget")]
            lines.append(f"| {mean // 1024}K | {nodes} | " + " | ".join(cells)
                         + f" | {totals['odc bound'] / steps:.1f} | {totals['zero3 bound'] / steps:.1f} |")
    return lines + [""]


def _over_bound(totals: dict, mode: str, bound: str, steps: int) -> str:
    return f"{totals[mode] / steps:.1f} ({100 * (totals[mode] / totals[bound] - 1):+.0f}%)"


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-simulator", action="store_true", help="closed forms only (skip the step simulator)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per GPU per simulated step")
    parser.add_argument("--steps", type=int, default=1, help="sampled steps per simulated cell")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.micro_batches < 1 or args.steps < 1:
        parser.error("--micro-batches and --steps must be >= 1")
    started = time.perf_counter()
    lines = ["## Across nodes: memory and traffic per cross_node mode", "",
             f"Projection ({DATE}): arithmetic from the formulas in `ds_odc/runtime/cross_node_plan.py` and "
             "the step simulator, not measured. Command: `.venv/bin/python benchmarks/multinode_projection.py`.", ""]
    lines += memory_section() + traffic_section() + time_section()
    if not args.no_simulator:
        lines += step_section(args.micro_batches, args.steps, args.seed)
    text = "\n".join(lines)
    print(text)
    print(f"({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return text


if __name__ == "__main__":
    main()
