"""How many pytest workers ``make test`` runs, and how: prints the pytest arguments (nothing: one process).

Two workers by default (``ODC_TEST_WORKERS`` sets another number; 0 or 1: one process), each in its own mount and
network namespaces (``tests/support/isolated_python``), files handed out whole (``--dist loadfile``: a module's
fixtures, e.g. the two-host pair and its one torchrun job, run once). The suite spends about a third of its time
waiting (bounded timeouts, stalled peers, sleeps, launches), which a second worker fills. Where the namespaces cannot
be made (not root, no ``unshare`` or ``ip``), the suite runs in one process, as before.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WRAPPER = os.path.join(HERE, "support", "isolated_python")


def isolation_works() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs tmpfs /dev/shm && ip link set lo up"], capture_output=True, timeout=30)
    return probe.returncode == 0


def arguments(workers: int) -> list:
    if workers <= 1 or not isolation_works():
        return []
    return ["--tx", f"{workers}*popen//python={WRAPPER}", "--dist", "loadfile"]


if __name__ == "__main__":
    count = int(os.environ.get("ODC_TEST_WORKERS", "2"))
    print(" ".join(arguments(count)))
    sys.exit(0)
