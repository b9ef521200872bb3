"""Project ODC + LB-Mini against ZeRO-3 + LB-Micro under Ulysses SP: 8-32 ranks, SP 2-8, 32K-128K tokens.

    .venv/bin/python benchmarks/sp_projection.py            # prints the table
    .venv/bin/python benchmarks/sp_projection.py --write    # and rewrites benchmarks/results/sp_projection.md

Every assumption is in benchmarks/sim/sequence_parallel.py (and the golden setting's in
benchmarks/sim/presets.py). Lengths: LongAlign-like scaled 2x (mean 33K tokens, clipped to 128K), 4 samples
per SP group per step, token cap 128K per group.
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

OUT = os.path.join(HERE, "results", "sp_projection.md")
CELLS = [(world, sp) for world in (8, 16, 32) for sp in (2, 4, 8)]
ALST = ("ALST's published maxima (sequence length that fits, not step time): Llama-8B 500K tokens on one H100, "
        "3.7M on 8, 15M on 32.")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true",
                        help="also write the table to benchmarks/results/sp_projection.md (tracked)")
    parser.add_argument("--out", help="also write the table to this file (instead of the tracked one)")
    args = parser.parse_args(argv)
    from benchmarks.sim.sequence_parallel import all_to_all_seconds_per_token, project_sp

    rows = ["| ranks | SP | groups | ZeRO-3 + LB-Micro s/step | ODC + LB-Micro | ODC + LB-Mini | utilisation "
            "(ZeRO-3 / ODC + LB-Mini) | all-to-all s per 1K tokens |", "|---|---|---|---|---|---|---|---|"]
    for world, sp in CELLS:
        p = project_sp(world, sp)
        base, micro, mini = (p.step_seconds[k] for k in (("collective", "lb-micro"), ("odc", "lb-micro"),
                                                         ("odc", "lb-mini")))
        rows.append(f"| {world} | {sp} | {world // sp} | {base:.1f} "
                    f"| {micro:.1f} ({p.speedup('odc', 'lb-micro'):+.0%}) "
                    f"| {mini:.1f} ({p.speedup('odc', 'lb-mini'):+.0%}) "
                    f"| {p.utilisation[('collective', 'lb-micro')]:.2f}"
                    f" / {p.utilisation[('odc', 'lb-mini')]:.2f} | {1000 * all_to_all_seconds_per_token(sp):.4f} |")
    text = "\n".join(["# Sequence parallelism: projected step time (simulator)", "", __doc__.strip().splitlines()[0],
                      "", *rows, "", ALST, ""])
    print(text)
    path = args.out or (OUT if args.write else None)
    if path:
        with open(path, "w") as out:
            out.write(text)
        print(f"wrote {path}")
    return text


if __name__ == "__main__":
    main()
