"""All or nothing, cell by cell: {exception caught and retried, exception uncaught, SIGKILL, SIGTERM,
SIGSTOP} x {allocate, forward, pull, push, fence, norm, publish, save} x {rank 0, last rank}.

In every cell every other rank ends with a clear ODC error naming the origin, within the bound (at
once for an error or a death, ``timeout_s`` for a stopped rank, the process group's timeout for a
rank stopped inside the start-up collectives); no rank hangs, nothing is left in /dev/shm (the
autouse fixture in conftest.py), no process is left over. A retried exception in forward or in a
pull (read-only) is the exception: there the step completes, equal to the undisturbed run.
"""
import os

import psutil
import pytest
import torch

from tests.support.fault_workloads import ACTIONS, PHASES, faulty_training
from tests.support.harness import run_ranks

WORLD = 2
TIMEOUT_S = 4.0  # ODC's no-progress bound in these runs
PG_TIMEOUT_S = 15.0  # the process group's: a rank stopped inside allocate's collectives
RETRYABLE = ("forward", "pull")
_reference = {}


def undisturbed(tmp_path_factory):
    if "params" not in _reference:
        directory = tmp_path_factory.mktemp("undisturbed")
        results = run_ranks(faulty_training, WORLD, "none", "retry", -1, str(directory / "marker"),
                            str(directory / "ckpt"), TIMEOUT_S, timeout=120)
        _reference["params"] = results[0]["params"]
    return _reference["params"]


def _leftover_children():
    """Processes this test started that are still there: ranks (forked by multiprocessing's
    forkserver, which itself stays for the session, as does its resource tracker) or anything else."""
    leftovers = []
    for child in psutil.Process().children():
        try:
            helper = any(name in " ".join(child.cmdline()) for name in ("forkserver", "resource_tracker"))
            found = child.children(recursive=True) if helper else [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        leftovers += [p.pid for p in found if _running(p)]
    return leftovers


def _running(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("target", [0, WORLD - 1], ids=["rank0", "last"])
@pytest.mark.parametrize("action", ACTIONS)
@pytest.mark.parametrize("phase", PHASES)
def test_fault(phase, action, target, tmp_path, tmp_path_factory):
    marker = str(tmp_path / "fired_at")
    others = [r for r in range(WORLD) if r != target]
    report = run_ranks(faulty_training, WORLD, phase, action, target, marker, str(tmp_path / "ckpt"), TIMEOUT_S,
                       timeout=90, report=True, wait_for=None if action != "sigstop" else others,
                       pg_timeout_s=PG_TIMEOUT_S)
    assert os.path.exists(marker), f"the fault never fired: {report.outcomes}"
    with open(marker) as fired:
        fired_at = float(fired.read())
    assert not _leftover_children()

    if action == "retry" and phase in RETRYABLE:  # the retried micro-batch gives the undisturbed result
        reference = undisturbed(tmp_path_factory)
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
