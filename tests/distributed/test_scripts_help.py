"""Every script under benchmarks/ and examples/ (a file with an ``if __name__ == "__main__":``, found by glob, so a
new one is covered without an edit here) answers ``--help`` with its usage and exit status 0, without running:
none starts a measurement, and none writes a tracked file (scripts rewrite benchmarks/results/ and docs/ only with
``--write``). The scripts run one after another in one process (tests/support/help_driver.py: the heavy imports are
paid once), within 60 s for all."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = re.compile(r"^if __name__ == [\"']__main__[\"']\s*:", re.M)
TIMEOUT_S = 60


def scripts() -> list[str]:
    """Repository-relative paths of the scripts under benchmarks/ and examples/ (subfolders included)."""
    found = []
    for folder in ("benchmarks", "examples"):
        for path in sorted(glob.glob(os.path.join(ROOT, folder, "**", "*.py"), recursive=True)):
            with open(path, encoding="utf-8") as source:
                if MAIN.search(source.read()):
                    found.append(os.path.relpath(path, ROOT))
    return found


SCRIPTS = scripts()


def _git(*args: str) -> str | None:
    """The output of a git command in the checkout, or None where git or the work tree is not there."""
    if shutil.which("git") is None:
        return None
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def _tracked_state() -> dict | None:
    """What a write to a tracked file changes: ``git status`` of tracked files, and each one's mtime (a rewrite
    with the same bytes leaves the status as it was, not the mtime)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    listed = _git("ls-files", "-z")
    if status is None or listed is None:
        return None
    mtimes = {}
    for name in filter(None, listed.split("\0")):
        try:
            mtimes[name] = os.stat(os.path.join(ROOT, name)).st_mtime_ns
        except OSError:
            mtimes[name] = None  # deleted in the work tree: the status shows it
    return {"status": status, "mtimes": mtimes}


def _helps(scripts: list) -> dict:
    """Each script's ``--help`` outcome: its exit status, what it printed and how long it took."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, os.path.join("tests", "support", "help_driver.py"), *scripts],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        out, err = done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout or ""
        err = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
    results = {}
    for line in out.splitlines():
        if line.startswith("{"):
            run = json.loads(line)
            results[run.pop("script")] = run
    unfinished = f"no outcome within {TIMEOUT_S} s for all; the driver's last lines:\n{err[-2000:]}"
    return {script: results.get(script, {"code": None, "stdout": unfinished, "seconds": None}) for script in scripts}


@pytest.fixture(scope="module")
def runs():
    before = _tracked_state()
    results = _helps(SCRIPTS)
    return {"results": results, "before": before, "after": _tracked_state()}


def test_the_glob_finds_the_scripts():
    assert "benchmarks/sp_projection.py" in SCRIPTS and "examples/train_causal_lm.py" in SCRIPTS, SCRIPTS
    assert "benchmarks/cells.py" not in SCRIPTS and "examples/packed_lm.py" not in SCRIPTS  # modules, no main


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_exits_0(runs, script):
    run = runs["results"][script]
    assert run["code"] == 0 and "usage" in run["stdout"], \
        f"{script} --help: exit {run['code']} after {run['seconds']} s\n{run['stdout'][-3000:]}"


def test_help_writes_no_tracked_file(runs):
    before, after = runs["before"], runs["after"]
    if before is None or after is None:
        pytest.skip("no git work tree here: nothing to compare")
    touched = sorted(name for name, mtime in after["mtimes"].items() if before["mtimes"].get(name) != mtime)
    assert after["status"] == before["status"] and not touched, \
        f"--help changed tracked files: {touched}\nbefore:\n{before['status']}\nafter:\n{after['status']}"
