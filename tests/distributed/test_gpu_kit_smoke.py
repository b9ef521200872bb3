"""The GPU validation kit's correctness phase, end to end on CPU ranks (``--cpu-smoke``: the ``shm``
transport, small selections), so that the kit's plumbing cannot rot between the rare GPU runs: the set-up
installs a wheel of this checkout into a private folder, the JIT build runs from it, every item runs in
its own process group, and results.json and the closing line say what happened. The CUDA-only items
must say they cannot be measured here, never pass."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ORDER = ["setup", "smoke", "harness", "jit-build", "kernel-sweep", "conformance", "training-parity", "nccl-one-rank",
         "fault-matrix", "activation-offload", "peer-atomics-distinct-gpus"]
PASSING = ["setup", "smoke", "harness", "jit-build", "conformance", "training-parity", "fault-matrix"]
NOT_MEASURABLE_HERE = ["kernel-sweep", "nccl-one-rank", "activation-offload", "peer-atomics-distinct-gpus"]


def test_the_correctness_phase_runs_end_to_end_on_cpu_ranks(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_validate.py"), "--cpu-smoke", "--out",
                           str(out)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=420)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    with open(out / "results.json") as handle:
        results = json.load(handle)
    statuses = {item["name"]: item["status"] for item in results["items"]}
    assert list(statuses) == ORDER  # the smoke test first, right after the set-up
    assert {name: statuses[name] for name in PASSING} == dict.fromkeys(PASSING, "pass"), output[-6000:]
    assert {name: statuses[name] for name in NOT_MEASURABLE_HERE} == dict.fromkeys(NOT_MEASURABLE_HERE,
                                                                                    "not_measurable")
    assert results["closing"] == f"{len(PASSING)} passed, 0 failed"
    assert done.stdout.strip().splitlines()[-1] == results["closing"]
    assert results["mode"] == "cpu-smoke (shm)" and results["environment"]["cpus"] == os.cpu_count()
    by_name = {item["name"]: item for item in results["items"]}
    jit = by_name["jit-build"]["figures"]
    assert jit["ops"]["ds_odc_atomics"]["build_s"] >= 0 and "site" in jit["ds_odc"]  # built from the installed wheel
    assert by_name["training-parity"]["figures"]["passed"] == 2 and by_name["setup"]["figures"]["installed"]
    assert sorted(os.listdir(out)) == ["log.txt", "results.json"]
