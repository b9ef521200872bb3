"""Runs each script named on the command line with ``--help``, one after another in this one process (``runpy``), so
that torch, DeepSpeed and transformers are imported once for all of them (tests/distributed/test_scripts_help.py).
Prints one JSON line per script to stdout: its exit status (or why there is none) and what it printed; on stderr,
the script it starts next, so that a run killed at its timeout names the script that did not stop."""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import time


def help_of(path: str) -> dict:
    printed, started = io.StringIO(), time.monotonic()
    argv, search_path = sys.argv, list(sys.path)
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            runpy.run_path(path, run_name="__main__")
        code: object = "returned without exiting: --help did the work"
    except SystemExit as exit_:
        code = 0 if exit_.code is None else exit_.code
    except BaseException as error:  # noqa: B036 - reported as the script's outcome, whatever it is
        code = f"raised {type(error).__name__}: {error}"
    finally:
        sys.argv, sys.path[:] = argv, search_path
    return {"code": code, "stdout": printed.getvalue(), "seconds": time.monotonic() - started}


def main(paths: list) -> int:
    sys.path.insert(0, os.getcwd())  # the repository: scripts import benchmarks.* and tests.support.*
    for path in paths:
        print(f"starting {path}", file=sys.stderr, flush=True)
        print(json.dumps({"script": path, **help_of(path)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
