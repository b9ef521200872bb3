"""DeepSpeed's own ZeRO-3 tests, run twice: as written (ZeRO-3) and with the stage swapped to "odc".

Nothing in their files changes: ``tests/compat/swap/sitecustomize.py`` rewrites ``"stage": 3`` to
``"odc"`` in every config reaching ``deepspeed.initialize``. The tests are not in DeepSpeed's pip
package, so getting them is an explicit step (``--deepspeed-tests``: the ``tests/`` directory of a
DeepSpeed checkout, ideally at the release ds_odc pins). Prints, per test, both outcomes, and exits 1
if any test that passes on ZeRO-3 does not pass on ODC.

    python tests/compat/run_deepspeed_tests.py --deepspeed-tests ~/DeepSpeed/tests \\
        unit/v1/zero/test_zero.py -k 3

CPU: ``DS_ACCELERATOR=cpu`` (set here) and ``LOCAL_SIZE=4``, which DeepSpeed's CPU accelerator reads
as its device count, so that tests of up to 4 ranks run instead of skipping.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

SWAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "swap")


def run_once(stage: str, tests_dir: str, pytest_args: list[str], timeout_s: int, odc_timeout_s: float) -> dict:
    """Run pytest under ``stage`` ("3" or "odc"); returns {test id: outcome}."""
    with tempfile.TemporaryDirectory(prefix="ds_odc_compat_") as scratch:
        report = os.path.join(scratch, "junit.xml")
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": os.environ.get("LOCAL_SIZE", "4"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "DS_UNITTEST_TIMEOUT": str(timeout_s), "DS_ODC_COMPAT_STAGE": stage,
               "DS_ODC_COMPAT_TIMEOUT_S": str(odc_timeout_s),
               "PYTHONPATH": os.pathsep.join(filter(None, [SWAP_DIR, os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}", *pytest_args]
        started = time.monotonic()
        done = subprocess.run(cmd, cwd=tests_dir, env=env, capture_output=True, text=True)
        print(f"stage {stage}: pytest exited {done.returncode} after {time.monotonic() - started:.0f} s", flush=True)
        if not os.path.exists(report):
            sys.stdout.write(done.stdout[-3000:] + done.stderr[-3000:])
            raise SystemExit(f"stage {stage}: no report (pytest could not run the tests)")
        return outcomes(report)


def outcomes(junit_xml: str) -> dict:
    results = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        results[name] = ("failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed")
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-tests", required=True, help="the tests/ directory of a DeepSpeed checkout")
    parser.add_argument("--timeout-s", type=int, default=300, help="DeepSpeed's per-test hang bound")
    parser.add_argument("--odc-timeout-s", type=float, default=60.0,
                        help="odc.timeout_s for swapped configs: a rank that stopped early fails its peers' test fast")
    args, pytest_args = parser.parse_known_args(argv)
    tests_dir = os.path.abspath(os.path.expanduser(args.deepspeed_tests))
    if not os.path.isfile(os.path.join(tests_dir, "unit", "common.py")):
        raise SystemExit(f"{tests_dir} is not DeepSpeed's tests/ directory (no unit/common.py)")
    zero3 = run_once("3", tests_dir, pytest_args, args.timeout_s, args.odc_timeout_s)
    odc = run_once("odc", tests_dir, pytest_args, args.timeout_s, args.odc_timeout_s)
    regressions = []
    print(f"\n{'test':100s} {'zero-3':8s} odc")
    for name in sorted(set(zero3) | set(odc)):
        a, b = zero3.get(name, "absent"), odc.get(name, "absent")
        print(f"{name:100s} {a:8s} {b}")
        if a == "passed" and b != "passed":
            regressions.append(name)
    for label, results in (("zero-3", zero3), ("odc", odc)):
        counts = {k: sum(1 for v in results.values() if v == k) for k in ("passed", "failed", "skipped")}
        print(f"{label}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if regressions:
        print(f"{len(regressions)} test(s) pass on ZeRO-3 and not on ODC:\n  " + "\n  ".join(regressions))
        return 1
    print("every test that passes on ZeRO-3 passes on ODC")
    return 0


if __name__ == "__main__":
    sys.exit(main())
