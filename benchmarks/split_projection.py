"""Splitting only the long samples, simulated: ODC + the split planner against ODC + LB-Mini,
ZeRO-3 + LB-Micro and fixed Ulysses SP of 2, 4 and 8, at 8/16/32 ranks and 1/2/4/8 samples per rank.

    .venv/bin/python benchmarks/split_projection.py            # prints the section
    .venv/bin/python benchmarks/split_projection.py --write    # and updates it in docs/benchmarks.md
    .venv/bin/python benchmarks/split_projection.py --quick    # 3 minibatches per cell, prints only

Workload: LongAlign-like lengths (lognormal σ=0.7, mean 16.5K, clipped to [512, 64K]), the paper's fitted 1.5B
cost read as A100 seconds, token cap 64K per rank, 20 minibatches per cell (the same ones for every method).
Machine: ``benchmarks.sim.presets.hierarchical_preset`` (8 ranks per node, 130 GB/s inside a node, pulls and
pushes inside the node, one exchange per step between nodes). All-to-alls: ``ds_odc.balance.split_cost``'s
defaults. The replay and the fixed-SP pricing: ``benchmarks/sim/split.py``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

DOC = os.path.join(ROOT, "docs", "benchmarks.md")
DOC_START, DOC_END = "<!-- split_projection:start -->", "<!-- split_projection:end -->"
HEADING = "## Splitting only the long samples: simulator projection (`benchmarks/split_projection.py`)"
GOAL = 0.15
NAMES = {"odc lb-mini": "ODC + LB-Mini", "zero3 lb-micro": "ZeRO-3 + LB-Micro", "sp 2": "fixed SP 2",
         "sp 4": "fixed SP 4", "sp 8": "fixed SP 8", "odc split": "ODC + split planner"}


def variants() -> list:
    """(name, keyword arguments of project_split) for the sensitivity table; the first is the main table's setting."""
    from ds_odc.balance.split_cost import AllToAllCost

    return [
        ("as in the main table", {}),
        ("largest group 4 (the 1.5B model: 12 query heads)", {"max_group": 4}),
        ("all-to-alls 4x slower (32.5 GB/s)", {"all_to_all": AllToAllCost(bandwidth=32.5e9)}),
        ("12 all-to-alls per layer (activation checkpointing)",
         {"all_to_all": AllToAllCost(all_to_alls_per_layer=12)}),
        ("min_chunk_tokens 4096", {"min_chunk_tokens": 4096}),
        ("heavier tail (length σ 1.0 instead of 0.7)", {"sigma": 1.0}),
    ]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="sampled minibatches per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="3 minibatches per cell; print, do not write the docs")
    parser.add_argument("--write", action="store_true",
                        help="update the section in docs/benchmarks.md (tracked; not with --quick)")
    parser.add_argument("--no-docs", action="store_true", help="print only (the default; overrides --write)")
    return parser.parse_args(argv)


def _cell(projection, method) -> str:
    if method not in projection.step_seconds:
        return "-"
    return f"{projection.step_seconds[method]:.2f} s · {100 * projection.idle[method]:.0f}%"


def main_table(steps: int, seed: int) -> tuple[list[str], dict]:
    from benchmarks.sim.split import METHODS, project_split

    projections = {(w, b): project_split(w, b, steps=steps, seed=seed) for w in (8, 16, 32) for b in (1, 2, 4, 8)}
    lines = ["| ranks | samples / rank | " + " | ".join(NAMES[m] for m in METHODS) + " |",
             "|---|---|" + "---|" * len(METHODS)]
    for (world, b), p in projections.items():
        lines.append(f"| {world} | {b} | " + " | ".join(_cell(p, m) for m in METHODS) + " |")
    lines += ["", "The split planner in detail (same minibatches):", "",
              "| ranks | samples / rank | idle, plan's cost model | idle, simulated (mean / worst step) | "
              "step vs LB-Mini | step vs best fixed SP | samples run split per step (over 2 / 4 / 8 ranks) | "
              "steps planned as a fixed-SP layout | plan ms (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for (world, b), p in projections.items():
        split = p.step_seconds["odc split"]
        best_sp = min((m for m in p.step_seconds if m.startswith("sp ")), key=lambda m: p.step_seconds[m])
        sizes = " / ".join(f"{p.group_sizes.get(q, 0):.1f}" for q in (2, 4, 8))
        lines.append(f"| {world} | {b} | {100 * p.plan_idle:.1f}% | {100 * p.idle['odc split']:.1f}% / "
                     f"{100 * p.worst_idle['odc split']:.1f}% | {split / p.step_seconds['odc lb-mini']:.3f}x | "
                     f"{split / p.step_seconds[best_sp]:.3f}x ({NAMES[best_sp]}) | {p.mean_splits:.1f} ({sizes}) | "
                     f"{p.fixed_share:.0%} | {p.plan_ms:.0f} |")
    return lines, projections


def sensitivity_table(steps: int, seed: int) -> list[str]:
    from benchmarks.sim.split import project_split

    lines = ["| variant | ranks | samples / rank | split planner: idle mean / worst | best fixed SP: idle mean / "
             "worst | step, split / best fixed SP |", "|---|---|---|---|---|---|"]
    for name, kwargs in variants():
        for world in (8, 16, 32):
            for b in (1, 2):
                p = project_split(world, b, steps=steps, seed=seed, methods=("sp 2", "sp 4", "sp 8", "odc split"),
                                  **kwargs)
                best = min((m for m in p.step_seconds if m.startswith("sp ")), key=lambda m: p.step_seconds[m])
                lines.append(f"| {name} | {world} | {b} | {100 * p.idle['odc split']:.1f}% / "
                             f"{100 * p.worst_idle['odc split']:.1f}% | {100 * p.idle[best]:.1f}% / "
                             f"{100 * p.worst_idle[best]:.1f}% ({NAMES[best]}) | "
                             f"{p.step_seconds['odc split'] / p.step_seconds[best]:.3f}x |")
    return lines


def goal_lines(projections: dict) -> list[str]:
    cells = [(w, b) for w in (8, 16, 32) for b in (1, 2)]
    met = [cell for cell in cells if projections[cell].idle["odc split"] <= GOAL]
    worst = max(cells, key=lambda cell: projections[cell].worst_idle["odc split"])
    return [f"Goal (idle ≤ {GOAL:.0%} at 1-2 samples per rank, 8-32 ranks), groups up to 8: met in {len(met)} of "
            f"{len(cells)} cells on the mean over minibatches; the worst single step of those cells idles "
            f"{100 * projections[worst].worst_idle['odc split']:.1f}% ({worst[0]} ranks, {worst[1]} per rank)."]


def write_docs(section: str) -> None:
    with open(DOC) as doc:
        text = doc.read()
    block = f"{DOC_START}\n{section}\n{DOC_END}"
    if DOC_START in text:
        text = text[:text.index(DOC_START)] + block + text[text.index(DOC_END) + len(DOC_END):]
    else:
        text = text.rstrip() + f"\n\n{HEADING}\n\n{block}\n"
    with open(DOC, "w") as doc:
        doc.write(text)


def main(argv=None) -> None:
    args = parse_args(argv)
    steps = 3 if args.quick else args.steps
    started = time.perf_counter()
    table, projections = main_table(steps, args.seed)
    command = ".venv/bin/python benchmarks/split_projection.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))
    section = "\n".join([
        f"Command: `{command}` ({datetime.date.today().isoformat()}; {steps} minibatches per cell, the same ones "
        "for every method; each cell is `mean step · mean idle`).", "",
        *table, "", *goal_lines(projections), "",
        "Sensitivity at 1-2 samples per rank (the split planner against the fastest fixed SP the variant allows):",
        "", *sensitivity_table(steps, args.seed), "",
        f"Simulated in {time.perf_counter() - started:.0f} s on this machine."])
    print(section)
    if args.write and not (args.quick or args.no_docs):
        write_docs(section)
        print(f"updated {os.path.relpath(DOC, ROOT)}")


if __name__ == "__main__":
    main()
