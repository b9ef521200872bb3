"""The examples run end to end under the launchers users run them with."""
import os
import subprocess
import sys

from tests.support.harness import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_causal_lm_example_trains_on_two_ranks_with_torchrun():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           os.path.join(ROOT, "examples", "train_causal_lm.py"), "--steps", "4"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "engine: ODCEngine, zero stage 3, 2 ranks" in output
    losses = [float(line.split("loss/token")[1].split("|")[0]) for line in output.splitlines() if "loss/token" in line]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses), output[-2000:]


def test_causal_lm_example_under_the_deepspeed_launcher_leaves_no_shared_memory():
    """The DeepSpeed launcher also makes DeepSpeed create its CPU all-reduce buffers in /dev/shm;
    an ODC engine unlinks them once every rank has mapped them."""
    port = free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # PATH stays the caller's: with .venv/bin prepended, torch would build DeepSpeed's CPU comm op with
    # the venv's ninja while every other run uses the system's, and each switch recompiles it (~50 s)
    cmd = [os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2", "--master_port", str(port),
           os.path.join(ROOT, "examples", "train_causal_lm.py"), "--steps", "2"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "engine: ODCEngine, zero stage 3, 2 ranks" in output
    leftovers = [name for name in os.listdir("/dev/shm") if f"_{port}_" in name]
    assert not leftovers, leftovers
