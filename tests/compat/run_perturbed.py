"""The contract and parity suites at timings a quiet machine rarely gives (opt-in; CI runs a slice of it,
tests/distributed/test_perturbed.py): once under CPU contention alone, then once per seed under schedule
perturbation (``DS_ODC_PERTURB``: a short random delay at every protocol point, drawn from the seed and the rank)
with the same contention. Contention is ``--busy`` processes spinning beside the suite (default: two per core), so
ranks are descheduled at arbitrary points, as on a loaded machine.

    python tests/compat/run_perturbed.py                         # contention, then seeds 1-5 (about an hour)
    python tests/compat/run_perturbed.py --seeds 7 --busy 0      # one seed, quiet machine
    python tests/compat/run_perturbed.py --deepspeed-tests <DeepSpeed checkout>/tests   # also DeepSpeed's own
                                                                 # ZeRO-3 tests, both stages, under contention

Prints each run's failures with the seed to rerun them with, and exits 1 if any run failed. Run it from the
checkout root with the test environment (tests/README.md).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from typing import List, Optional

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
#: The contract and parity suites: what must hold at any timing.
SUITES = ["tests/unit/test_step_protocol.py", "tests/unit/test_rounds_outside_a_step.py",
          "tests/unit/test_exact_sum.py", "tests/unit/test_residency.py",
          "tests/distributed/test_zero3_contracts.py", "tests/distributed/test_interleavings.py",
          "tests/distributed/test_parity.py", "tests/distributed/test_uneven.py",
          "tests/distributed/test_dynamic_micro_batches.py", "tests/distributed/test_deterministic.py",
          "tests/distributed/test_sync.py", "tests/distributed/test_frozen_engines.py",
          "tests/distributed/test_offload_states.py", "tests/distributed/test_checkpoint.py",
          "tests/distributed/test_transport_conformance.py"]


class Contention:
    """``count`` processes spinning on the CPU for as long as the block lasts (killed on the way out)."""

    def __init__(self, count: int):
        self.count = count
        self.procs: List[subprocess.Popen] = []

    def __enter__(self) -> "Contention":
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()


def failures(junit: pathlib.Path) -> List[str]:
    found = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            found.append(f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}")
    return found


def run_suites(suites: List[str], seed: Optional[int], busy: int, extra: List[str]) -> tuple:
    """``(passed, failed test ids, seconds)`` of one pytest run of ``suites``."""
    with tempfile.TemporaryDirectory(prefix="ds_odc_perturbed_") as scratch:
        junit = pathlib.Path(scratch) / "junit.xml"
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        env.pop("DS_ODC_PERTURB", None)
        if seed is not None:
            env["DS_ODC_PERTURB"] = str(seed)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *extra,
                   *suites]
        started = time.monotonic()
        with Contention(busy):
            done = subprocess.run(command, cwd=CHECKOUT, env=env, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if not junit.exists():
            return 0, ["<pytest could not run>: " + done.stdout[-2000:]], seconds
        cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
        failed = failures(junit)
        return len(cases) - len(failed), failed, seconds


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="*", default=[1, 2, 3, 4, 5])
    parser.add_argument("--busy", type=int, default=2 * (os.cpu_count() or 1), help="spinning processes beside it")
    parser.add_argument("--suites", nargs="*", default=SUITES)
    parser.add_argument("--no-contention-run", action="store_true", help="skip the run under contention alone")
    parser.add_argument("--deepspeed-tests", help="DeepSpeed's tests/ directory: also run its test_zero.py -k 3 on "
                                                  "both stages under the same contention")
    args, extra = parser.parse_known_args(argv)
    runs = ([] if args.no_contention_run else [None]) + list(args.seeds)
    broken = []
    for seed in runs:
        label = f"DS_ODC_PERTURB={seed}" if seed is not None else "contention only"
        passed, failed, seconds = run_suites(args.suites, seed, args.busy, extra)
        print(f"{label}, {args.busy} busy processes: {passed} passed, {len(failed)} failed in {seconds:.0f}s",
              flush=True)
        for test in failed:
            print(f"    FAILED {test}  (rerun: {label if seed is not None else 'under contention'})", flush=True)
            broken.append((label, test))
    if args.deepspeed_tests:
        with Contention(args.busy):
            code = subprocess.call([sys.executable, str(CHECKOUT / "tests" / "compat" / "run_deepspeed_tests.py"),
                                    "--deepspeed-tests", args.deepspeed_tests, "unit/v1/zero/test_zero.py", "-k", "3"],
                                   cwd=CHECKOUT)
        verdict = "every ZeRO-3 pass passes on odc" if code == 0 else "REGRESSIONS"
        print(f"DeepSpeed's test_zero.py -k 3 under contention: {verdict}")
        if code != 0:
            broken.append(("deepspeed tests", "test_zero.py -k 3"))
    print(f"\n{len(runs)} run(s): " + ("all passed" if not broken else f"{len(broken)} failure(s)"))
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
