"""The DeepSpeed launcher with a hostfile and ``--num_nodes 1`` (the form multi-node jobs use, on
one node) runs an unmodified "odc" training script. ``--num_gpus 2`` and torchrun are covered by
test_examples.py."""
import os
import re
import subprocess
import sys

import pytest

from tests.support.harness import free_port, run_ranks
from tests.support.launcher_workloads import (
    initialize_odc,
    pretend_interleaved_nodes,
    pretend_one_host_per_rank,
    pretend_uneven_nodes,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "support", "launched_script.py")


def test_deepspeed_launcher_with_a_hostfile_on_one_node(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one node, two CPU ranks\nlocalhost slots=2\n")
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # PATH stays the caller's: with .venv/bin prepended, torch would build DeepSpeed's CPU comm op with
    # the venv's ninja while every other run uses the system's, and each switch recompiles it (~50 s)
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--hostfile", str(hostfile), "--num_nodes", "1",
           "--no_ssh_check", "--master_addr", "127.0.0.1", "--master_port", str(port), SCRIPT]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    ranks = dict(re.findall(r"launched rank (\d)/2 local_rank (\d) engine ODCEngine", output))
    assert ranks == {"0": "0", "1": "1"}, output[-3000:]
    assert not [name for name in os.listdir("/dev/shm") if f"_{port}_" in name]


@pytest.mark.parametrize("world,setup,expected", [
    (3, pretend_uneven_nodes, "nodes hold different numbers of ranks ({'node-0': 2, 'node-1': 1})"),
    (4, pretend_interleaved_nodes, "ranks [0, 2] share host 'node-0'; a multi-node layout needs ranks numbered "
                                   "node by node ([0, 1] there)"),
], ids=["uneven-nodes", "interleaved-ranks"])
def test_a_multi_node_layout_odc_cannot_serve_fails_at_initialize_naming_the_hosts(world, setup, expected):
    """Every rank raises the same ODCConfigError before anything is allocated; nothing hangs."""
    messages = run_ranks(initialize_odc, world, setup=setup)
    for message in messages:
        assert message is not None and message.startswith("ODCConfigError: " + expected), message


def test_ranks_reporting_different_hosts_run_as_nodes():
    """Two ranks that report different host names are two nodes of one rank each: each rank's windows
    are its node's, the step exchanges between them (the real two-host tests are test_two_hosts.py)."""
    assert run_ranks(initialize_odc, 2, setup=pretend_one_host_per_rank) == [None, None]
