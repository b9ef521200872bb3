"""The benchmark pipeline end to end on a tiny workload: both engines, plans, reports, JSON and PNG.
(It measures nothing worth reading at this size; it checks the command keeps working.)"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_balance_matrix_smoke_run(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "balance_matrix.py"), "--smoke", "--results", str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with open(tmp_path / "balance_matrix.json") as results:
        data = json.load(results)
    rows = {(r["engine"], r["policy"]): r for r in data["runs"]}
    assert set(rows) == {("zero3", "lb-micro"), ("odc", "lb-mini")}
    for row in rows.values():
        assert row["samples_per_s"] > 0 and all(0 < u <= 1 for u in row["utilisation"])
        assert len(row["step_seconds"]) == 1 and row["steps"][0]["micro_batches"]
    assert rows[("zero3", "lb-micro")]["balance_bound"] == 1.0
    assert rows[("odc", "lb-mini")]["balance_bound"] >= 1.0
    with open(tmp_path / "timeline.png", "rb") as png:
        assert png.read(4) == b"\x89PNG"


def test_hf_trainer_balance_smoke_run():
    """Every cell of the Trainer benchmark starts, trains, and reports (one warm-up and one timed step; nothing
    written)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "hf_trainer_balance.py"), "--smoke"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    table = json.loads(done.stdout[done.stdout.index("{\n"):])
    rows = table["2"]
    assert set(rows) == {"zero3", "zero3+lb-micro", "odc+lb-micro", "odc+lb-mini"}
    for row in rows.values():
        assert row["samples_per_s"] > 0 and all(0 < u <= 1 for u in row["utilisation"])
    assert rows["zero3"]["micro_batches"] == [2, 2]  # the Trainer as run today: one sample per micro-batch
