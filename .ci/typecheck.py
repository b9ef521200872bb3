"""mypy over ds_odc/ (settings in pyproject.toml), held to two bars:

* no error at all in the packages named by ``--clean``;
* elsewhere at most ``--baseline`` errors: the count when the check was introduced. Lower the baseline
  (Makefile, ``MYPY_BASELINE``) when a change fixes some; a change that adds one fails here.

    python .ci/typecheck.py --baseline 80 --clean ds_odc/balance/ ds_odc/activations/
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys

ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+: error: ")


def errors(output: str) -> list[tuple[str, str]]:
    """(path, line) of every error mypy printed."""
    found = []
    for line in output.splitlines():
        match = ERROR.match(line)
        if match:
            found.append((match["path"], line))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=int, required=True)
    parser.add_argument("--clean", nargs="*", default=[])
    args = parser.parse_args(argv)
    done = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 2: mypy itself failed (bad settings, a crash): nothing was counted
        sys.stdout.write(done.stdout + done.stderr)
        print(f"typecheck: mypy exited with {done.returncode}")
        return done.returncode
    found = errors(done.stdout)
    in_clean = [line for path, line in found if any(path.startswith(prefix) for prefix in args.clean)]
    elsewhere = [line for path, line in found if not any(path.startswith(prefix) for prefix in args.clean)]
    failed = False
    if in_clean:
        print("\n".join(in_clean))
        print(f"typecheck: {len(in_clean)} error(s) in {', '.join(args.clean)}, which must have none")
        failed = True
    if len(elsewhere) > args.baseline:
        print("\n".join(elsewhere))
        print(f"typecheck: {len(elsewhere)} errors outside the clean packages, more than the baseline of "
              f"{args.baseline}: the change above added {len(elsewhere) - args.baseline}")
        failed = True
    if failed:
        return 1
    print(f"typecheck: no error in {', '.join(args.clean) or '(none)'}; {len(elsewhere)} elsewhere "
          f"(baseline {args.baseline})")
    if len(elsewhere) < args.baseline:
        print(f"typecheck: fewer errors than the baseline: lower MYPY_BASELINE in the Makefile to {len(elsewhere)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
