"""Paired timings of two commands: run A and B in turn, ``-n`` times each, and compare their medians.

The machines this project measures on are shared and noisy, so a speed claim is a ratio of medians of
alternating runs, never one run against another. Each run is a whole process (start-up included); a
command that prints a JSON line with a ``"samples_per_s"`` (or ``--figure NAME``) is also compared on
that figure, which excludes start-up (``--figure`` again for more figures).

    python benchmarks/paired.py -n 3 \\
        --a ".venv/bin/python benchmarks/sequence_parallel.py --method odc-lb-mini" \\
        --b ".venv/bin/python benchmarks/sequence_parallel.py --method zero3-lb-micro"

Prints one line per run and a summary (min / median / max of each, and A / B of the medians).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from typing import Optional


def last_json_figure(output: str, name: str) -> Optional[float]:
    """``name`` from the last line of ``output`` that parses as a JSON object holding it."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line).get(name)
            except json.JSONDecodeError:
                continue
            if isinstance(value, (int, float)):
                return float(value)
    return None


def run_once(command: str, timeout_s: float) -> tuple:
    """(wall seconds, output) of one run; a failed run stops the comparison."""
    started = time.monotonic()
    done = subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-2000:] + done.stderr[-2000:])
        raise SystemExit(f"{command!r} exited {done.returncode}")
    return wall, done.stdout


def summary(label: str, values: list) -> str:
    return f"{label}: min {min(values):.3f} median {statistics.median(values):.3f} max {max(values):.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="command A (the change)")
    parser.add_argument("--b", required=True, help="command B (the baseline)")
    parser.add_argument("-n", type=int, default=3, help="runs of each, alternating A, B, A, B, ...")
    parser.add_argument("--figure", action="append",
                        help="a figure the commands print as JSON (repeat for several; default samples_per_s)")
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    names = args.figure or ["samples_per_s"]
    walls: dict = {"A": [], "B": []}
    figures: dict = {(label, name): [] for label in ("A", "B") for name in names}
    for i in range(args.n):
        for label, command in (("A", args.a), ("B", args.b)):
            wall, output = run_once(command, args.timeout_s)
            walls[label].append(wall)
            line = f"run {i + 1} {label}: wall {wall:.2f} s"
            for name in names:
                figure = last_json_figure(output, name)
                if figure is not None:
                    figures[(label, name)].append(figure)
                    line += f", {name} {figure:.3f}"
            print(line, flush=True)
    for label in ("A", "B"):
        print(summary(f"{label} wall s", walls[label]))
        for name in names:
            if figures[(label, name)]:
                print(summary(f"{label} {name}", figures[(label, name)]))
    print(f"A / B wall (medians): {statistics.median(walls['A']) / statistics.median(walls['B']):.3f}")
    for name in names:
        if figures[("A", name)] and figures[("B", name)]:
            ratio = statistics.median(figures[("A", name)]) / statistics.median(figures[("B", name)])
            print(f"A / B {name} (medians): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
