"""Proof of the suite's strength: seed each mutant of tests/mutants/ into a scratch copy of this checkout, run the
suite against it, and report whether it was killed, by which test first, and how long that took (opt-in; not
collected by pytest).

For each mutant, the runner looks in widening circles and stops at the first failing test:

1. the mutant's ``tests`` (the killer found last time);
2. the tests whose files import the mutated module (by name, through tests/support too);
3. the whole default suite (``make test``'s selection), unless ``--no-widen``.

    python tests/compat/run_mutants.py                       # every mutant
    python tests/compat/run_mutants.py h07 c03               # these only
    python tests/compat/run_mutants.py --report mutants.md   # also write the table (markdown)

A mutant that survives all three is a gap in the suite: write the test that kills it. Run it from the checkout root
with the test environment (``DS_ACCELERATOR=cpu OMP_NUM_THREADS=1`` and the JIT-built operators' directory, as
tests/README.md shows); every run uses this checkout's ``.venv`` with ``PYTHONPATH`` on the scratch copy, so spawned
ranks, torchrun and the launcher all import the mutated package.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from typing import List, Optional

CHECKOUT = pathlib.Path(__file__).resolve().parents[2]
if str(CHECKOUT) not in sys.path:
    sys.path.insert(0, str(CHECKOUT))

from tests.mutants import Mutant, every  # noqa: E402

IGNORED = shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache",
                                 ".mypy_cache", ".ruff_cache")


@dataclass
class Verdict:
    mutant: Mutant
    killed: bool
    killer: str  # the first failing test's id ("" if none)
    seconds: float  # from the start of the first circle to the failure (or to the end)
    circle: str  # which circle killed it: "its tests", "importers", "whole suite", or "" (survived)
    detail: str = ""


def module_name(path: str) -> str:
    return path[:-3].replace("/", ".") if path.endswith(".py") else path


def _imports(name: str) -> re.Pattern:
    """Import statements of module ``name`` (``import a.b``, ``from a.b import x``, ``from a import b``)."""
    parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    forms = [rf"^\s*import {re.escape(name)}\b", rf"^\s*from {re.escape(name)} import "]
    if parent:
        forms.append(rf"^\s*from {re.escape(parent)} import [^\n]*\b{re.escape(leaf)}\b")
    return re.compile("|".join(forms), re.MULTILINE)


def importers(mutant: Mutant, root: pathlib.Path) -> List[str]:
    """Test files of the default suite that import the mutated module, directly or through a tests/support
    module that does."""
    pattern = _imports(module_name(mutant.file))
    support = [f"tests.support.{p.stem}" for p in (root / "tests" / "support").glob("*.py")
               if pattern.search(p.read_text())]
    through = [_imports(name) for name in support]
    found = []
    for path in sorted((root / "tests").glob("*/test_*.py")):
        if path.parent.name not in ("unit", "distributed"):
            continue
        text = path.read_text()
        if pattern.search(text) or any(p.search(text) for p in through):
            found.append(str(path.relative_to(root)))
    return found


def node_id(root: pathlib.Path, classname: str, name: str) -> str:
    """A pytest node id from junit's ``classname`` (``tests.unit.test_x`` or ``tests.unit.test_x.TestClass``)."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[cut:], name])
    return f"{classname}::{name}"


def run_pytest(root: pathlib.Path, selection: List[str], timeout_s: float, extra: List[str]) -> tuple:
    """``(failed test id or "", seconds, detail)`` of ``pytest -x`` over ``selection`` in ``root``. A run that
    hangs is a kill too (the suite never finishes): pytest's faulthandler names the test it hung in, and the
    whole process group is killed at ``timeout_s``."""
    junit = root / ".mutant-junit.xml"
    junit.unlink(missing_ok=True)
    extensions = os.environ.get("TORCH_EXTENSIONS_DIR", str(CHECKOUT / ".venv" / "torch_extensions"))
    env = dict(os.environ, PYTHONPATH=str(root), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=extensions)
    command = [str(CHECKOUT / ".venv" / "bin" / "python"), "-m", "pytest", "-x", "-vv", "-p", "no:cacheprovider",
               "--durations=0", f"--junitxml={junit}", *extra, *selection]
    started = time.monotonic()
    with subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            running = [line.split(" ", 1)[0] for line in output.splitlines() if "::" in line and " PASSED" not in line
                       and " FAILED" not in line and " SKIPPED" not in line and " ERROR" not in line]
            hung = running[-1] if running else "<a test>"
            return f"{hung} (hung: killed after {timeout_s:.0f}s)", time.monotonic() - started, output[-2000:]
    done = subprocess.CompletedProcess(command, proc.returncode, output, "")
    seconds = time.monotonic() - started
    if not junit.exists():
        return ("<collection>" if done.returncode not in (0, 5) else ""), seconds, done.stdout[-2000:]
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            return node_id(root, case.get("classname", ""), case.get("name", "")), seconds, ""
    if done.returncode not in (0, 5):  # e.g. an error at collection
        return "<collection>", seconds, done.stdout[-2000:]
    return "", seconds, ""


def judge(mutant: Mutant, widen: bool, timeout_s: float, control: bool = False) -> Verdict:
    """Run the circles against ``mutant`` seeded (with ``control``, against the unmutated copy, every circle but
    the whole suite: a "kill" then means the scratch copy itself is broken, or the test fails without the
    mutant)."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"ds_odc_mutant_{mutant.id}_"))
    try:
        root = scratch / "checkout"
        shutil.copytree(CHECKOUT, root, ignore=IGNORED, symlinks=True)
        if not control:
            mutant.apply(root)
        circles = [("its tests", list(mutant.tests)),
                   ("importers", [t for t in importers(mutant, root) if t not in mutant.tests])]
        if widen:
            circles.append(("whole suite", ["tests"]))
        spent = 0.0
        for circle, selection in circles:
            if not selection:
                continue
            killer, seconds, detail = run_pytest(root, selection, timeout_s, [])
            spent += seconds
            if killer:
                return Verdict(mutant, True, killer, spent, circle, detail)
        return Verdict(mutant, False, "", spent, "")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def table(verdicts: List[Verdict]) -> str:
    lines = ["| mutant | kind | what it re-seeds | killed by | circle | seconds |",
             "| --- | --- | --- | --- | --- | --- |"]
    for v in verdicts:
        lines.append(f"| `{v.mutant.id}` | {v.mutant.kind} | {v.mutant.name} | "
                     f"{f'`{v.killer}`' if v.killed else '**survived**'} | {v.circle} | {v.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="mutant ids (file stems, or prefixes of them); default: every one")
    parser.add_argument("--no-widen", action="store_true", help="never run the whole suite for a mutant")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
    parser.add_argument("--report", help="write the markdown table here too")
    parser.add_argument("--control", action="store_true",
                        help="run each mutant's first circle unmutated (every test must pass: the harness is sound)")
    args = parser.parse_args(argv)
    mutants = [m for m in every() if not args.ids or any(m.id == i or m.id.startswith(i) for i in args.ids)]
    if not mutants:
        print("no mutant matches", args.ids)
        return 2
    if args.control:
        broken = [v for v in (judge(m, False, args.timeout, control=True) for m in mutants) if v.killed]
        for v in broken:
            print(f"{v.mutant.id}: {v.killer} fails WITHOUT the mutant", v.detail)
        print(f"control: {len(mutants) - len(broken)} of {len(mutants)} mutants' circles pass unmutated")
        return 1 if broken else 0
    verdicts = []
    for mutant in mutants:
        verdict = judge(mutant, not args.no_widen, args.timeout)
        verdicts.append(verdict)
        state = f"killed by {verdict.killer} ({verdict.circle})" if verdict.killed else "SURVIVED"
        print(f"{mutant.id}: {state} in {verdict.seconds:.0f}s", flush=True)
        if verdict.detail:
            print("   ", verdict.detail.strip().replace("\n", "\n    ")[-1500:], flush=True)
    print()
    print(table(verdicts))
    if args.report:
        pathlib.Path(args.report).write_text(table(verdicts) + "\n")
    survived = [v.mutant.id for v in verdicts if not v.killed]
    print(f"\n{len(verdicts) - len(survived)} of {len(verdicts)} killed"
          + (f"; survived: {survived}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
