"""Random feature combinations against their reference, for as long as you let it run (opt-in; CI runs the fixed
seeds of tests/distributed/test_combinations.py instead).

Draws seeds at random, runs their jobs (tests/support/combination_jobs.py) in batches in one world of 2 CPU ranks
each, on the odc stage and, where it can run the same job, on ZeRO-3, and judges every one against one process on
the same samples, or against the refusal the oracle predicts. Prints each failing job's seed, its description and
what was wrong, as it is found, and a summary at the end; exits 1 if any job failed. A failing seed is reproduced
alone with ``--seeds``:

    python tests/compat/run_combinations.py --minutes 60
    python tests/compat/run_combinations.py --seeds 123456 98765     # these jobs only
    python tests/compat/run_combinations.py --minutes 30 --no-zero3  # the one-process reference only (faster)

Run it from the checkout root with the test environment (``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1`` and the JIT-built
operators' directory, as tests/README.md shows for pytest). docs/combinations.md says what the jobs cover.
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60.0, help="stop drawing new batches after this long")
    parser.add_argument("--seeds", type=int, nargs="*", help="run these seeds only (a failing job, reproduced)")
    parser.add_argument("--batch", type=int, default=12, help="jobs per world of ranks (start-up amortised)")
    parser.add_argument("--no-zero3", action="store_true", help="skip ZeRO-3's run of the jobs it can run")
    parser.add_argument("--start", type=int, default=None, help="draw seeds from this random state (default: new)")
    args = parser.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from tests.support.combination_jobs import expected_refusal
    from tests.support.combination_reference import run_seeds

    rng = random.Random(args.start)
    deadline = time.monotonic() + 60 * args.minutes
    started = time.monotonic()
    totals: collections.Counter = collections.Counter()
    failures = []

    def report(job, problems, records):
        seed = job.seed
        refusal = expected_refusal(job)
        totals["jobs"] += 1
        totals["refused as predicted" if refusal is not None and not problems else "trained"] += not problems
        if records is not None and any(r.get("zero3") for r in records):
            totals["also against ZeRO-3"] += 1
        if problems:
            failures.append((seed, job.describe(), problems))
            print(f"FAIL seed {seed}: {job.describe()}", flush=True)
            for problem in problems:
                print("    " + problem.replace("\n", "\n    "), flush=True)
        else:
            print(f"ok   seed {seed} ({'refused: ' + refusal.reason if refusal else job.rule + ' rule'})", flush=True)

    with tempfile.TemporaryDirectory(prefix="run_combinations_") as workdir:
        if args.seeds:
            run_seeds(args.seeds, workdir, zero3=not args.no_zero3, on_result=report)
        while not args.seeds and time.monotonic() < deadline:
            seeds = [rng.randrange(2 ** 31) for _ in range(args.batch)]
            run_seeds(seeds, workdir, zero3=not args.no_zero3, on_result=report)
    minutes = (time.monotonic() - started) / 60
    print(f"\n{totals['jobs']} jobs in {minutes:.1f} min: {totals['trained']} trained as one process, "
          f"{totals['refused as predicted']} refused as predicted, {totals['also against ZeRO-3']} also against "
          f"ZeRO-3, {len(failures)} failed")
    for seed, description, problems in failures:
        print(f"  seed {seed}: {description}\n    {problems[0].splitlines()[0]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
