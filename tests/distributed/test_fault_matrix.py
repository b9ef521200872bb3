"""All or nothing, cell by cell: {exception caught and retried, exception uncaught, SIGKILL, SIGTERM,
SIGSTOP} x {allocate, forward, pull, push, fence, norm, publish, save} x {rank 0, last rank}.

In every cell every other rank ends with a clear ODC error naming the origin, within the bound (at
once for an error or a death, ``timeout_s`` for a stopped rank, the process group's timeout for a
rank stopped inside the start-up collectives); no rank hangs, nothing is left in /dev/shm (checked after
the matrix, and by the autouse fixture in conftest.py), no process is left over. A retried exception in
forward or in a pull (read-only) is the exception: there the step completes, equal to the undisturbed run.

The cells are independent jobs, each its own ranks and ``/dev/shm`` session, and most of a cell is waiting (for
``timeout_s`` after a stopped rank, for a process to die): they run :data:`CONCURRENT` at a time, in one module
fixture, and each test checks its cell.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from tests.support.fault_workloads import ACTIONS, PHASES, faulty_training
from tests.support.harness import run_ranks

WORLD = 2
TIMEOUT_S = 4.0  # ODC's no-progress bound in these runs
PG_TIMEOUT_S = 15.0  # the process group's: a rank stopped inside allocate's collectives
RETRYABLE = ("forward", "pull")
TARGETS = {"rank0": 0, "last": WORLD - 1}
CELLS = [(phase, action, target) for phase in PHASES for action in ACTIONS for target in TARGETS]
#: Cells running at once: each is 2 ranks, mostly waiting; the bounds asserted hold with this many beside it.
CONCURRENT = 4


def _running(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _still_running(pids) -> list:
    """Which of ``pids`` (a cell's ranks) and their descendants are still running."""
    running = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            found = [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        running += [p.pid for p in found if _running(p)]
    return running


def _run_cell(cell, directory):
    phase, action, target = cell
    target = TARGETS[target]
    marker = os.path.join(directory, "fired_at")
    others = [r for r in range(WORLD) if r != target]
    report = run_ranks(faulty_training, WORLD, phase, action, target, marker, os.path.join(directory, "ckpt"),
                       TIMEOUT_S, timeout=90, report=True, wait_for=None if action != "sigstop" else others,
                       pg_timeout_s=PG_TIMEOUT_S)
    fired_at = None
    if os.path.exists(marker):
        with open(marker) as fired:
            fired_at = float(fired.read())
    return report, fired_at, _still_running(report.pids)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every cell's ``(report, fired_at, leftover pids)`` or the exception its run raised, and the undisturbed
    run's parameters; then nothing of any cell may be left in /dev/shm or running."""
    results, lock = {}, threading.Lock()

    def run(cell):
        directory = str(tmp_path_factory.mktemp("-".join(map(str, cell))))
        try:
            outcome = _run_cell(cell, directory)
        except Exception as err:  # noqa: BLE001 - the cell's test reports it
            outcome = err
        with lock:
            results[cell] = outcome

    before = {n for n in os.listdir("/dev/shm") if n.startswith("ds_odc_")}
    with ThreadPoolExecutor(CONCURRENT) as pool:
        undisturbed = pool.submit(run_ranks, faulty_training, WORLD, "none", "retry", -1,
                                  str(tmp_path_factory.mktemp("undisturbed") / "marker"),
                                  str(tmp_path_factory.mktemp("undisturbed_ckpt")), TIMEOUT_S, timeout=120)
        list(pool.map(run, CELLS))
        reference = undisturbed.result()[0]["params"]
    left = {n for n in os.listdir("/dev/shm") if n.startswith("ds_odc_")} - before
    assert not left, f"the fault matrix left shared memory behind: {sorted(left)}"
    return results, reference


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("phase", PHASES)
def test_fault(matrix, phase, action, target):
    results, reference = matrix
    outcome = results[(phase, action, target)]
    if isinstance(outcome, Exception):
        raise outcome
    report, fired_at, leftovers = outcome
    target = TARGETS[target]
    others = [r for r in range(WORLD) if r != target]
    assert fired_at is not None, f"the fault never fired: {report.outcomes}"
    assert not leftovers, leftovers

    if action == "retry" and phase in RETRYABLE:  # the retried micro-batch gives the undisturbed result
        for rank in range(WORLD):
            status, outcome = report.outcomes[rank]
            assert status == "ok" and outcome["completed"], (rank, outcome)
            for name, expected in reference.items():
                actual = outcome["params"][name]
                assert torch.allclose(actual, expected, rtol=0, atol=1e-7), (name, (actual - expected).abs().max())
        assert [e[0] for e in report.outcomes[target][1]["errors"]] == ["InjectedFault"]
        return

    bound = {"sigstop": (PG_TIMEOUT_S if phase == "allocate" else TIMEOUT_S) + 10.0}.get(action, 10.0)
    for rank in others:
        status, outcome = report.outcomes[rank]
        assert status == "ok" and not outcome["completed"], (rank, outcome)
        kind, message, raised_at = outcome["errors"][-1]
        assert kind in ("ODCPeerError", "ODCTimeoutError", "ODCGroupFailedError", "ODCConfigError"), (kind, message)
        assert f"rank {target}" in message, message
        if action in ("retry", "uncaught"):
            # the harness catches the target's exception, reports it, then tears its group down: the peers
            # learn of that (left training), or of its exit, or of the exception itself
            assert any(cause in message for cause in ("InjectedFault", "exited", "left training")), message
        assert raised_at - fired_at < bound, (raised_at - fired_at, message)

    status, outcome = report.outcomes.get(target, ("hung", None))
    if action == "retry":
        assert status == "ok" and not outcome["completed"], outcome
        assert outcome["errors"][0][0] == "InjectedFault", outcome
        if phase != "allocate":
            kind, message, _ = outcome["errors"][-1]
            assert kind == "ODCGroupFailedError" and f"rank {target} failed" in message, outcome
    elif action == "uncaught":
        assert status == "error" and "InjectedFault" in outcome, outcome
    elif action == "sigstop":
        assert target in report.hung_ranks
    else:
        signal_number = {"sigkill": 9, "sigterm": 15}[action]
        assert status == "error" and f"exited with code -{signal_number}" in outcome, outcome
