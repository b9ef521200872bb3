"""The GPU validation kit's first command, end to end on CPU ranks (``--cpu-smoke``: the ``shm`` transport,
small selections), so that the kit's plumbing cannot rot between the rare GPU runs: the set-up installs a
wheel of this checkout into a private folder, every pytest item imports that wheel (not the checkout),
every item runs in its own process group, and results.json and the closing line say what happened. The
CUDA-only items must say they cannot be measured here, never pass.

The run takes one item of each kind the first command has (a one-rank pytest item, a parity item with its
figures, a fault item, the CUDA-only ones); the items it leaves out run the same runner path with another
selection, and each of those selections is collected (it names tests that exist and load on CPU ranks). The
transport conformance and 4-rank parity they would run are tests/distributed/test_transport_conformance.py and the
parity suites, run on their own.

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

ORDER = ["machine", "setup", "cuda-op", "kernel-sweep", "smoke", "parity-2-fp32", "fault-push", "bandwidth", "overlap"]
PASSING = ["machine", "setup", "smoke", "parity-2-fp32", "fault-push"]
NOT_MEASURABLE_HERE = ["cuda-op", "kernel-sweep", "bandwidth", "overlap"]
#: The first command's items the run leaves out: their selections are collected instead.
COLLECTED_ONLY = ["conformance-core", "conformance-edges", "parity-4-bf16-token"]
RUN = [name for name in ORDER if name not in ("machine", "setup", "cuda-op")]


def _env():
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def test_the_first_command_runs_end_to_end_on_cpu_ranks(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, KIT, "--cpu-smoke", "--only", *RUN, "--out", str(out)], env=_env(), cwd=ROOT,
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


def test_the_items_left_out_of_the_smoke_select_tests_that_load_on_cpu_ranks():
    """One collection of their test files on CPU ranks (as the kit's items see them: the shm transport), and each
    item's ``-k`` selection matched against it as pytest matches names."""
    from _pytest.mark.expression import Expression

    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        from gpu_validation import items
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))
    ctx = items.Context(ROOT, "<work>", sys.executable, "", "", cpu_smoke=True)
    first = {item.name: item for item in items.first(ctx)}
    assert set(first) == set(RUN) | set(COLLECTED_ONLY), sorted(first)  # every item is run above or collected here
    selections, paths = {}, []
    for name in COLLECTED_ONLY:
        command = first[name].command
        selections[name] = command[command.index("-k") + 1]
        paths += [part for part in command if part.startswith("tests/") and part not in paths]
    env = {**_env(), **{k: v for k, v in first[COLLECTED_ONLY[0]].env.items() if k != "PYTHONPATH"}}
    done = subprocess.run([sys.executable, "-m", "pytest", *paths, "-p", "no:cacheprovider", "--collect-only"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    for name, selection in selections.items():
        expression = Expression.compile(selection)
        chosen = [test for test in collected if expression.evaluate(lambda word, test=test: word in test)]
        assert chosen, (name, selection, collected)


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
