#!/usr/bin/env python3
"""GPU validation kit, step 2 of 2: validate ds_odc's GPU path on the machine this runs on.

    python3 scripts/gpu_validate.py --phase correctness --out $OUT     # under 9 minutes
    python3 scripts/gpu_validate.py --phase performance --out $OUT     # under 9 minutes
    python scripts/gpu_validate.py --cpu-smoke --out DIR              # the correctness phase on CPU ranks (CI)

Step 1 (``bash scripts/gpu_kit.sh``, where a package index is reachable) gathers the wheels the GPU machine
lacks into ``.gpu_kit/``; carry that folder. Each phase installs them and a wheel of this checkout into a
private folder, runs every item of the phase (``scripts/gpu_validation/items.py``) in its own process
group under its own timeout, and writes into ``--out``: ``results.json`` (the machine, then per item its
verdict: pass / fail / not measurable on this machine / inconclusive, seconds, figures, the error) and
``log.txt`` (every item's output), plus the performance phase's ``gpu_transport.md`` and ``timeline.png``.
It ends with ``N passed, N failed``; the exit status is 1 when an item failed.

``--cpu-smoke`` runs the correctness phase end to end on the ``shm`` transport with small selections, so
that the kit's plumbing is tested in CI (tests/distributed/test_gpu_kit_smoke.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_validation import environment, items  # noqa: E402
from gpu_validation.runner import Phase  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 510.0  # a device command may run 10 minutes; the phase stays under 9, start-up and copy-back included
SMOKE_BUDGET_S = 300.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--phase", choices=["correctness", "performance"], default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="the correctness phase on CPU ranks (shm)")
    parser.add_argument("--out", required=True, help="folder for results.json, log.txt and the figures")
    parser.add_argument("--wheels", help="the carried wheels (default: .gpu_kit/wheels; with --cpu-smoke none: the "
                                         "interpreter's own packages are used, the carried ones are for CPython 3.12)")
    parser.add_argument("--work", help="scratch folder (default: a fresh temporary one, removed at the end)")
    parser.add_argument("--budget", type=float, help="seconds for the whole phase (default 510; smoke 300)")
    parser.add_argument("--only", nargs="+", help="run only these items (by name); the others are not listed")
    args = parser.parse_args(argv)
    if args.cpu_smoke and args.phase == "performance":
        parser.error("--cpu-smoke runs the correctness phase (performance needs a GPU)")
    if not args.cpu_smoke and args.phase is None:
        parser.error("give --phase correctness|performance (or --cpu-smoke)")
    args.phase = args.phase or "correctness"
    if args.wheels is None and not args.cpu_smoke:
        args.wheels = os.path.join(ROOT, ".gpu_kit", "wheels")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    clock_start = time.monotonic()  # the phase's budget includes reading the machine
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    work = args.work or tempfile.mkdtemp(prefix=f"ds_odc_gpu_validate_{args.phase}_")
    python = sys.executable
    machine = environment.describe(python)
    ctx = items.Context(root=ROOT, work=work, python=python, wheels=os.path.abspath(args.wheels) if args.wheels else "",
                        cpu_smoke=args.cpu_smoke, gpus=machine.get("gpus", 0), sanitizer=machine["compute_sanitizer"],
                        cuda_home=machine["cuda_home"]["set"])
    mode = "cpu-smoke (shm)" if args.cpu_smoke else "gpu (cuda_ipc)"
    header = {"mode": mode, "started": started, "command": " ".join([os.path.basename(python), *sys.argv]),
              "environment": machine}
    budget = args.budget or (SMOKE_BUDGET_S if args.cpu_smoke else BUDGET_S)
    phase = Phase(args.phase, os.path.abspath(args.out), work, budget, header, started=clock_start)
    print(f"ds_odc GPU validation: phase {args.phase}, {mode}, budget {budget:.0f} s; {machine.get('gpus', 0)} GPU(s) "
          f"{[d['name'] for d in machine.get('devices', [])]}, driver {machine.get('driver')}, torch "
          f"{machine.get('torch')} (CUDA {machine.get('torch_cuda')}), Python {machine['python']}", flush=True)
    todo = items.correctness(ctx) if args.phase == "correctness" else items.performance(ctx)
    if args.only:
        unknown = set(args.only) - {item.name for item in todo}
        if unknown:
            raise SystemExit(f"--only: no item named {sorted(unknown)}; items: {[item.name for item in todo]}")
        todo = [item for item in todo if item.name in args.only or item.name == "setup"]
    try:
        for item in todo:
            result = phase.run(item)
            if item.name == "setup" and result.status.value != "pass":
                for rest in todo[todo.index(item) + 1:]:
                    phase.skip(rest, items.Status.INCONCLUSIVE, "not run: the set-up failed")
                break
    finally:
        status = phase.finish()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
