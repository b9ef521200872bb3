"""A rank killed mid-training on the GPU transport: the survivor raises the project's peer error
(``ODCPeerError`` naming the rank), never a CUDA fault, within seconds, and its device still computes.

SIGKILL at forward, inside a push and at the fence (tests/distributed/test_fault_matrix.py runs every
phase and action on CPU); and an owner killed in its forward while a peer's pulls from its window are
in flight (``OWNER_DIES_MID_PULL``). Skipped without CUDA (run on ``shm`` by the kit's ``--cpu-smoke``).
"""
import os

import pytest

from tests.support.fault_workloads import OWNER_DIES_MID_PULL, faulty_training
from tests.support.harness import run_ranks
from tests.support.transports import gpu_suite_case, gpu_suite_skip, rank_env

CASE = gpu_suite_case()
pytestmark = gpu_suite_skip()

WORLD = 2
TIMEOUT_S = 5.0
BOUND_S = 15.0  # a death is named at once; this allows for a slow GPU start of the survivor's next step


@pytest.mark.parametrize("phase,target", [("forward", 1), ("push", 0), ("fence", 1), (OWNER_DIES_MID_PULL, 0)],
                         ids=["forward", "push", "fence", "owner-dies-mid-pull"])
def test_survivor_raises_the_peer_error_and_keeps_a_working_device(phase, target, tmp_path):
    marker = str(tmp_path / "fired_at")
    survivor = 1 - target
    report = run_ranks(faulty_training, WORLD, phase, "sigkill", target, marker, str(tmp_path / "ckpt"), TIMEOUT_S,
                       timeout=180, report=True, env=rank_env(CASE.name, WORLD))
    assert os.path.exists(marker), f"the fault never fired: {report.outcomes}"
    with open(marker) as fired:
        fired_at = float(fired.read())
    status, outcome = report.outcomes[target]
    assert status == "error" and "exited with code -9" in outcome, outcome

    status, outcome = report.outcomes[survivor]
    assert status == "ok" and not outcome["completed"], (status, outcome)
    kind, message, raised_at = outcome["errors"][-1]
    assert kind == "ODCPeerError", (kind, message)  # not a RuntimeError from CUDA
    assert f"rank {target}" in message, message
    assert raised_at - fired_at < BOUND_S, (raised_at - fired_at, message)
    assert outcome["device_ok"], outcome["device_error"]
