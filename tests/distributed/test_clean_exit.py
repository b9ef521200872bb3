"""A script that ends right after a gloo collective, destroying nothing, exits cleanly: no
"terminate called without an active exception" (SIGABRT) from a gloo worker thread caught by
Python's finalization (cause and fix: ds_odc/integration/clean_exit.py).

Without the exit hook, ``exit_script.py`` aborted in 6 of 8 torchrun jobs on the 2-core test
machine (ZeRO-3: 4 of 8); with it, 0 of 8 (each). Three jobs therefore catch a regression with
probability about 1 - 0.25**3 = 98%."""
import os
import socket
import subprocess
import sys

import pytest

from ds_odc.integration import clean_exit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "exit_script.py")
JOBS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ending_right_after_a_collective_does_not_abort_at_exit():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop(clean_exit.OFF_SWITCH, None)
    for job in range(1, JOBS + 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(_free_port()), SCRIPT, "odc"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
        output = done.stdout + done.stderr
        assert "terminate called" not in output and done.returncode == 0, f"job {job}/{JOBS}:\n{output[-4000:]}"
        assert output.count("engine ODCEngine exit hook on") == 2, output[-3000:]


def test_the_hook_is_installed_once_per_process_and_can_be_switched_off(monkeypatch):
    registered = []
    monkeypatch.setattr(clean_exit.atexit, "register", registered.append)
    monkeypatch.setattr(clean_exit, "_installed_pid", None)
    assert clean_exit.install() and clean_exit.install() and clean_exit.installed()
    assert registered == [clean_exit._at_exit]

    monkeypatch.setattr(clean_exit, "_installed_pid", os.getpid() + 1)  # as a forked child sees it
    assert not clean_exit.installed()
    monkeypatch.setattr(clean_exit, "wait_for_idle_gloo_workers", lambda timeout_s: pytest.fail("ran in a child"))
    clean_exit._at_exit()

    monkeypatch.setattr(clean_exit, "_installed_pid", None)
    monkeypatch.setenv(clean_exit.OFF_SWITCH, "0")
    assert not clean_exit.install() and registered == [clean_exit._at_exit]


def test_no_gloo_worker_means_no_wait():
    assert clean_exit._worker_tids() == []  # pytest's process has no process group
    assert clean_exit.wait_for_idle_gloo_workers(timeout_s=5.0)
