"""``python -m ds_odc check`` run as a process, as a user runs it before launching a job: its exit codes and what
it prints (the in-process cases: unit/test_check_command.py)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check(*args):
    return subprocess.run([sys.executable, "-m", "ds_odc", "check", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})


def test_check_end_to_end_on_the_examples_config_then_a_refused_one(tmp_path):
    done = _check("examples/ds_config_odc.json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("examples/ds_config_odc.json: valid for the odc stage\n")
    assert "machine ..." in done.stdout and "cpu, 1 node(s) x 1 rank(s) per node" in done.stdout  # DS_ACCELERATOR
    assert "odc.timeout_s ......" in done.stdout and " 60.0\n" in done.stdout
    assert "managed_gradient_accumulation false" in done.stdout
    refused = tmp_path / "refused.json"
    refused.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1,
                                   "zero_optimization": {"stage": "odc", "odc": {"transport": "nvshmem"}}}))
    done = _check(str(refused), "--json")
    assert done.returncode == 1 and json.loads(done.stdout)["error"].startswith("zero_optimization.odc.transport")
