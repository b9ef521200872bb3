#!/usr/bin/env python3
"""GPU validation kit, step 2 of 2: validate ds_odc's GPU path on the machine this runs on, in one command.

    python3 scripts/gpu_validate.py --out $OUT                  # the first command: ~330 s (give it 420 s)
    python3 scripts/gpu_validate.py --second --out $OUT         # only if time is left: <= 300 s
    python3 scripts/gpu_validate.py --only smoke bandwidth --out $OUT      # rerun items (either command's)
    python3 scripts/gpu_validate.py --budget 200 --out $OUT     # fit the time left on the machine
    python3 scripts/gpu_validate.py --list                      # every item, in order, and what it runs
    python scripts/gpu_validate.py --cpu-smoke --out DIR        # the first command on CPU ranks (CI)

Step 1 (``bash scripts/gpu_kit.sh``, here) gathers into ``.gpu_kit/`` the wheels the GPU machine lacks and
the CUDA operator prebuilt for it; carry that folder. Every command first reads the machine, installs the
wheels and a wheel of this checkout into a work folder (``.gpu_work/``, kept between commands on the same
machine, so a second command or a rerun installs and builds nothing again), loads the CUDA operator (the
prebuilt one when its fingerprint matches, else a build, said which), then runs its items in order
(``scripts/gpu_validation/items.py``), each in its own process group under a timeout of at most 90 s; an
item that does not fit in what is left of the budget is not started.

Everything streams into ``--out`` (a command killed at its limit still returns what it found):
``results.json`` (the machine, then per item its verdict: pass / fail / not measurable on this machine /
inconclusive, seconds, figures, the error; the running item listed as ``running``; the ``--only`` command
that reruns what failed), ``current-item.txt`` (the running item's output, as it comes), ``log.txt`` (every
finished item's output), and the figures' ``gpu_transport.md`` and ``timeline.png``. It ends with
``N passed, N failed``; the exit status is 1 when an item failed.

``--cpu-smoke`` runs the first command end to end on the ``shm`` transport with small selections, so that
the kit's plumbing is tested in CI (tests/distributed/test_gpu_kit_smoke.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_validation import items  # noqa: E402
from gpu_validation.runner import Phase, Status  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_BUDGET_S = 330.0  # the decisive validation, leaving a lease of 15 minutes time for a rerun after a fix
SECOND_BUDGET_S = 290.0  # the second command stays under 300 s
SMOKE_BUDGET_S = 480.0  # CPU ranks on a small CI machine are slower than the GPU machine the budgets are for


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", help="folder for results.json, log.txt, current-item.txt and the figures")
    parser.add_argument("--second", action="store_true", help="the second command (only if time is left)")
    parser.add_argument("--cpu-smoke", action="store_true", help="on CPU ranks (shm): the kit's plumbing, for CI")
    parser.add_argument("--budget", type=float,
                        help=f"seconds for the whole command (default {FIRST_BUDGET_S:.0f}; "
                             f"--second {SECOND_BUDGET_S:.0f}; --cpu-smoke {SMOKE_BUDGET_S:.0f})")
    parser.add_argument("--only", nargs="+", help="run only these items (of either command), after the machine, "
                                                  "set-up and operator items")
    parser.add_argument("--list", action="store_true", help="list both commands' items and exit")
    parser.add_argument("--wheels", help="the carried wheels (default: .gpu_kit/wheels; with --cpu-smoke none: the "
                                         "interpreter's own packages are used, the carried ones are for CPython 3.12)")
    parser.add_argument("--prebuilt", help="the carried prebuilt operator (default: .gpu_kit/ops)")
    parser.add_argument("--work", help="work folder (default: .gpu_work, kept between commands; with --cpu-smoke a "
                                       "temporary one, removed at the end)")
    args = parser.parse_args(argv)
    if not args.out and not args.list:
        parser.error("give --out DIR (on the GPU machine: --out $OUT)")
    if args.wheels is None and not args.cpu_smoke:
        args.wheels = os.path.join(ROOT, ".gpu_kit", "wheels")
    args.prebuilt = args.prebuilt or os.path.join(ROOT, ".gpu_kit", "ops")
    return args


def item_lists(ctx: items.Context):
    return items.preamble(ctx), items.first(ctx), items.second(ctx)


def listing(ctx: items.Context) -> str:
    preamble, first, second = item_lists(ctx)
    parts = [("every command starts with", [items.machine_item(ctx)] + preamble), ("first command", first),
             ("second command (--second)", second)]
    return "\n".join(f"{title}:\n" + "\n".join(f"  {i.name:26} {i.title}" for i in todo) for title, todo in parts)


def _stop(signum, frame):
    """SIGTERM (a timeout wrapper, CI): end like Ctrl-C, so the running item's processes are killed and
    results.json is written once more."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    clock_start = time.monotonic()  # the budget includes reading the machine and the set-up
    if args.list:
        ctx = items.Context(ROOT, "<work>", sys.executable, args.wheels or "", args.prebuilt, args.cpu_smoke)
        print(listing(ctx))
        return 0
    work = args.work or (tempfile.mkdtemp(prefix="ds_odc_gpu_validate_") if args.cpu_smoke
                         else os.path.join(ROOT, ".gpu_work"))
    name = "second command" if args.second else "first command"
    mode = "cpu-smoke (shm)" if args.cpu_smoke else "gpu (cuda_ipc)"
    budget = args.budget or (SMOKE_BUDGET_S if args.cpu_smoke else SECOND_BUDGET_S if args.second else FIRST_BUDGET_S)
    header = {"mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "work": work,
              "command": " ".join([os.path.basename(sys.executable), *sys.argv])}
    phase = Phase(name, os.path.abspath(args.out), work, budget, header, started=clock_start)
    ctx = items.Context(ROOT, work, sys.executable, os.path.abspath(args.wheels) if args.wheels else "",
                        os.path.abspath(args.prebuilt), args.cpu_smoke)
    print(f"ds_odc GPU validation: {name}, {mode}, budget {budget:.0f} s, work folder {work}", flush=True)
    try:
        machine = phase.run(items.machine_item(ctx))
        ctx.machine = machine.figures
        phase.header["environment"] = machine.figures
        preamble, first, second = item_lists(ctx)
        todo = preamble + items.select(first + second if args.only else (second if args.second else first),
                                       args.only)
        for item in todo:
            if machine.status != Status.PASS:
                phase.skip(item, Status.INCONCLUSIVE, "not run: the machine item failed")
                continue
            result = phase.run(item)
            if item.required and result.status == Status.FAIL:
                for rest in todo[todo.index(item) + 1:]:
                    phase.skip(rest, Status.INCONCLUSIVE, f"not run: {item.name} failed")
                break
    finally:
        status = phase.finish()
        if args.cpu_smoke and not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
