"""The GPU validation kit's first command, end to end on CPU ranks (``--cpu-smoke``: the ``shm`` transport,
small selections), so that the kit's plumbing cannot rot between the rare GPU runs: the set-up installs a
wheel of this checkout into a private folder, every pytest item imports that wheel (not the checkout),
every item runs in its own process group, and results.json and the closing line say what happened. The
CUDA-only items must say they cannot be measured here, never pass.

And what a device command killed at its limit leaves: results.json naming the item that was running, and
that item's output so far, in the output folder."""
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KIT = os.path.join(ROOT, "scripts", "gpu_validate.py")

ORDER = ["machine", "setup", "cuda-op", "kernel-sweep", "smoke", "conformance-core", "conformance-edges",
         "parity-2-fp32", "parity-4-bf16-token", "fault-push", "bandwidth", "overlap"]
PASSING = ["machine", "setup", "smoke", "conformance-core", "conformance-edges", "parity-2-fp32",
           "parity-4-bf16-token", "fault-push"]
NOT_MEASURABLE_HERE = ["cuda-op", "kernel-sweep", "bandwidth", "overlap"]


def _env():
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def test_the_first_command_runs_end_to_end_on_cpu_ranks(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, KIT, "--cpu-smoke", "--out", str(out)], env=_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    with open(out / "results.json") as handle:
        results = json.load(handle)
    statuses = {item["name"]: item["status"] for item in results["items"]}
    assert list(statuses) == ORDER  # the machine, the set-up and the operator first, then what tells the most
    assert {name: statuses[name] for name in PASSING} == dict.fromkeys(PASSING, "pass"), output[-6000:]
    assert {name: statuses[name] for name in NOT_MEASURABLE_HERE} == dict.fromkeys(NOT_MEASURABLE_HERE,
                                                                                    "not_measurable")
    assert results["closing"] == f"{len(PASSING)} passed, 0 failed" and results["rerun"] is None
    assert done.stdout.strip().splitlines()[-1] == results["closing"]
    assert results["mode"] == "cpu-smoke (shm)" and results["environment"]["cpus"] == os.cpu_count()
    assert results["environment"]["sharing"]["shared"] is True
    by_name = {item["name"]: item for item in results["items"]}
    assert by_name["parity-2-fp32"]["figures"]["passed"] == 1 and by_name["setup"]["figures"]["installed"]
    assert "CPU-only" in by_name["cuda-op"]["error"]
    assert sorted(os.listdir(out)) == ["log.txt", "results.json"]  # within the device's 8 files, no folder
    log = (out / "log.txt").read_text()
    assert f"ds_odc from {results['work']}" in log or "(the installed wheel)" in log  # not the checkout's


def test_a_kit_killed_in_the_middle_of_an_item_leaves_results_and_that_item_s_output(tmp_path):
    from ds_odc.comm.segments import sweep_orphans

    out, work = tmp_path / "out", tmp_path / "work"
    kit = subprocess.Popen([sys.executable, KIT, "--cpu-smoke", "--only", "smoke", "--out", str(out), "--work",
                            str(work)], env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    running, deadline = None, time.monotonic() + 240
    try:
        while time.monotonic() < deadline and kit.poll() is None:  # until the smoke test itself has started
            try:
                items = json.loads((out / "results.json").read_text())["items"]
                streamed = (out / "current-item.txt").read_text()
            except (FileNotFoundError, ValueError):
                items, streamed = [], ""
            if items and items[-1]["name"] == "smoke" and "test_cuda_smoke.py::" in streamed:
                running = items[-1]
                break
            time.sleep(0.2)
        assert running is not None, f"the smoke item never showed as running (kit exit {kit.poll()})"
        os.killpg(kit.pid, signal.SIGKILL)  # as a device command killed at its limit: no clean-up at all
        kit.wait()
    finally:
        for group in (kit.pid, (running or {}).get("process_group")):  # the device kills everything left
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, TypeError, PermissionError):
                pass
        time.sleep(0.5)
        sweep_orphans("/dev/shm")  # files of ranks killed between reserving and unlinking them
    results = json.loads((out / "results.json").read_text())
    assert [(i["name"], i["status"]) for i in results["items"]] == [("machine", "pass"), ("setup", "pass"),
                                                                    ("cuda-op", "not_measurable"), ("smoke", "running")]
    assert results["items"][-1]["output"] == "current-item.txt" and results["items"][-1]["process_group"] > 0
    streamed = (out / "current-item.txt").read_text()
    assert "tests/gpu/test_cuda_smoke.py::test_one_rank_trains_one_step_on_its_device_with_its_transport" in streamed
    assert "setup: pass" in (out / "log.txt").read_text()  # the finished items' output is there too
