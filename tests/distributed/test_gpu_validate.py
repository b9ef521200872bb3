"""The validation kit's orchestration (scripts/gpu_validation): timeouts that kill whole process groups,
the four verdicts, the budget, what streams into the output folder while an item runs, the results file
and its closing line, and how each kind of output is read (a pass must mean something was tested).
Tiny stand-in items (a command that exits 1, one that sleeps past its timeout); no GPU, no DeepSpeed."""
import json
import os
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_validation import verdicts  # noqa: E402
from gpu_validation.runner import Item, Phase, Run, Status, Verdict, run_command  # noqa: E402

PY = sys.executable


def py(code):
    return [PY, "-c", textwrap.dedent(code)]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone for our purposes
        return stat.read().split(")")[-1].split()[0] != "Z"


def test_run_command_reports_exit_status_and_output(tmp_path):
    run = run_command(py("import sys; print('hello'); sys.exit(3)"), 30, output_path=str(tmp_path / "out"))
    assert run.returncode == 3 and "hello" in run.output and not run.timed_out


def test_a_command_past_its_timeout_is_killed_with_everything_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """
    start = time.monotonic()
    run = run_command(py(code), 3, output_path=str(tmp_path / "out"), grace_s=1)
    assert run.timed_out and time.monotonic() - start < 15
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not alive(child), "the command's child outlived the timeout"


def test_what_a_command_leaves_running_is_killed_when_it_exits(tmp_path):
    pid_file = tmp_path / "orphan.pid"
    code = f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
    """
    run = run_command(py(code), 30, output_path=str(tmp_path / "out"))
    assert run.returncode == 0 and not run.timed_out
    time.sleep(0.2)
    assert not alive(int(pid_file.read_text()))


def test_a_phase_gives_every_item_one_verdict_and_ends_with_the_counts(tmp_path, capsys):
    out, work = str(tmp_path / "out"), str(tmp_path / "work")
    phase = Phase("first command", out, work, budget_s=60, header={"environment": {"gpus": 0}})

    def broken(run):
        raise KeyError("figure")

    items = [
        Item("ok", "exits 0", py("print('fine')"), 30, expect_s=1),
        Item("exits-1", "exits 1", py("import sys; sys.exit(1)"), 30, expect_s=1),
        Item("hangs", "sleeps past its timeout", py("import time; time.sleep(60)"), 2, expect_s=1),
        Item("one-gpu", "needs two GPUs", unavailable="needs two GPUs; this machine has 1"),
        Item("derived", "read from 'ok'", derive=lambda done: Verdict(done["ok"].status, {"from": "ok"})),
        Item("unreadable", "its interpreter raises", py("pass"), 30, interpret=broken, expect_s=1),
        Item("figures", "writes a file its interpreter reads",
             py("import json, sys; json.dump({'x': 1.5}, open(sys.argv[1], 'w'))") + ["{scratch}/f.json"], 30,
             interpret=lambda run: Verdict(Status.PASS, verdicts.read_json(run, "f.json")), expect_s=1,
             note="what a pass here does not show"),
    ]
    for item in items:
        phase.run(item)
    assert phase.finish() == 1  # something failed
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "3 passed, 3 failed"
    assert lines[-2] == "rerun: python3 scripts/gpu_validate.py --only exits-1 hangs unreadable --out $OUT"
    assert lines[-3] == "first command: 1 not measurable on this machine, 0 inconclusive"
    with open(os.path.join(out, "results.json")) as handle:
        results = json.load(handle)
    statuses = {item["name"]: item["status"] for item in results["items"]}
    assert statuses == {"ok": "pass", "exits-1": "fail", "hangs": "fail", "one-gpu": "not_measurable",
                        "derived": "pass", "unreadable": "fail", "figures": "pass"}
    by_name = {item["name"]: item for item in results["items"]}
    assert "timed out after 2 s" in by_name["hangs"]["error"] and by_name["hangs"]["seconds"] < 15
    assert "exit status 1" in by_name["exits-1"]["error"]
    assert "KeyError" in by_name["unreadable"]["error"]
    assert by_name["figures"]["figures"] == {"x": 1.5, "note": "what a pass here does not show"}
    assert by_name["derived"]["figures"] == {"from": "ok"}
    assert results["closing"] == "3 passed, 3 failed" and results["environment"] == {"gpus": 0}
    assert results["summary"] == {"pass": 3, "fail": 3, "not_measurable": 1, "inconclusive": 0}
    assert sorted(os.listdir(out)) == ["log.txt", "results.json"]  # no current-item.txt once nothing runs
    log = open(os.path.join(out, "log.txt")).read()
    assert "fine" in log and all(f"{item.name}: " in log for item in items)


def test_the_running_item_streams_its_output_and_is_listed_as_running(tmp_path):
    """While an item runs, results.json names it (with its process group) and its output is in
    current-item.txt as it comes: a command killed at its limit still returns both."""
    code = """
        import json, os, sys
        print("first line of the item", flush=True)
        out = sys.argv[1]
        listed = json.load(open(os.path.join(out, "results.json")))["items"][-1]
        streamed = open(os.path.join(out, "current-item.txt")).read()
        print("SEEN " + json.dumps({"listed": listed, "streamed": streamed}), flush=True)
    """
    phase = Phase("first command", str(tmp_path / "out"), str(tmp_path / "work"), budget_s=60, header={})
    result = phase.run(Item("peeks", "reads the output folder while it runs", py(code) + ["{out}"], 30,
                            interpret=lambda run: Verdict(Status.PASS, verdicts.tagged_json(run.output, "SEEN")),
                            expect_s=1))
    seen = result.figures
    assert seen["listed"]["name"] == "peeks" and seen["listed"]["status"] == "running"
    assert seen["listed"]["output"] == "current-item.txt" and seen["listed"]["process_group"] > 0
    assert seen["streamed"] == "first line of the item\n"
    assert not os.path.exists(tmp_path / "out" / "current-item.txt")  # moved into log.txt at the end
    assert "first line of the item" in open(tmp_path / "out" / "log.txt").read()


def test_an_item_that_cannot_finish_in_what_is_left_is_not_started_and_a_started_one_is_cut_at_the_budget(tmp_path):
    phase = Phase("first command", str(tmp_path / "out"), str(tmp_path / "work"), budget_s=4, header={})
    marker = tmp_path / "ran"
    too_long = phase.run(Item("too-long", "usually takes 10 s", py(f"open({str(marker)!r}, 'w')"), 30, expect_s=10))
    assert too_long.status == Status.INCONCLUSIVE and "not started" in too_long.error and "--only" in too_long.error
    assert not marker.exists()
    cut = phase.run(Item("slow", "outlasts the budget", py("import time; time.sleep(60)"), 60, expect_s=1))
    assert cut.status == Status.INCONCLUSIVE and "stopped at the budget" in cut.error and cut.seconds < 15
    assert phase.finish() == 0 and phase.closing_line() == "0 passed, 0 failed"


# -- reading outputs -------------------------------------------------------------------------------------
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_a" name="test_ok" time="1.5"/>
<testcase classname="tests.gpu.test_a" name="test_skip" time="0"><skipped message="needs a CUDA device"/></testcase>
{extra}</testsuite></testsuites>"""


def junit_run(tmp_path, returncode, extra=""):
    (tmp_path / "junit.xml").write_text(JUNIT.format(extra=extra))
    return Run(returncode, 1.0, "", scratch=str(tmp_path))


def test_pytest_results(tmp_path):
    """A pass only when every selected test ran: some skipped is inconclusive."""
    verdict = verdicts.pytest_verdict(junit_run(tmp_path, 0))
    assert verdict.status == Status.INCONCLUSIVE and verdict.figures["passed"] == 1 and verdict.figures["skipped"] == 1
    assert verdict.figures["skip_reasons"] == ["needs a CUDA device"] and "1 of 2 selected tests" in verdict.error
    only_passed = JUNIT.format(extra="").replace('<testcase classname="tests.gpu.test_a" name="test_skip" time="0">'
                                                 '<skipped message="needs a CUDA device"/></testcase>', "")
    (tmp_path / "junit.xml").write_text(only_passed)
    assert verdicts.pytest_verdict(Run(0, 1.0, "", scratch=str(tmp_path))).status == Status.PASS
    failure = ('<testcase classname="tests.gpu.test_a" name="test_bad" time="2">'
               '<failure message="assert 1 == 2">tb</failure></testcase>')
    verdict = verdicts.pytest_verdict(junit_run(tmp_path, 1, failure))
    assert verdict.status == Status.FAIL and "test_bad: assert 1 == 2" in verdict.error
    (tmp_path / "junit.xml").write_text(JUNIT.format(extra="").replace('<testcase classname="tests.gpu.test_a" '
                                                                        'name="test_ok" time="1.5"/>', ""))
    verdict = verdicts.pytest_verdict(Run(0, 1.0, "", scratch=str(tmp_path)))
    assert verdict.status == Status.NOT_MEASURABLE and "needs a CUDA device" in verdict.error
    assert verdicts.pytest_verdict(Run(5, 1.0, "", scratch=str(tmp_path))).status == Status.FAIL  # nothing selected
    os.unlink(tmp_path / "junit.xml")
    crashed = verdicts.pytest_verdict(Run(-11, 1.0, "Segmentation fault", scratch=str(tmp_path)))
    assert crashed.status == Status.FAIL and "Segmentation fault" in crashed.error


PASSED_ONLY = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1">
<testcase classname="tests.gpu.test_push_kernel" name="test_sweep" time="3"/></testsuite></testsuites>"""
SKIPPED_ONLY = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1">
<testcase classname="tests.gpu.test_push_kernel" name="test_sweep" time="0"><skipped message="no CUDA"/></testcase>
</testsuite></testsuites>"""


@pytest.mark.parametrize("output,returncode,junit,expected", [
    ("========= ERROR SUMMARY: 0 errors\n========= ERROR SUMMARY: 0 errors\n", 0, PASSED_ONLY, Status.PASS),
    ("========= ERROR SUMMARY: 0 errors\n", 0, SKIPPED_ONLY, Status.INCONCLUSIVE),
    ("========= ERROR SUMMARY: 0 errors\n", 0, None, Status.INCONCLUSIVE),
    ("========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 3 errors\n", 99, PASSED_ONLY,
     Status.FAIL),
    ("========= Error: Device not supported\n========= ERROR SUMMARY: 0 errors\n", 0, PASSED_ONLY, Status.INCONCLUSIVE),
    ("python: no such file\n", 1, None, Status.INCONCLUSIVE),
    ("========= ERROR SUMMARY: 0 errors\n", 1, PASSED_ONLY, Status.INCONCLUSIVE),
], ids=["clean", "clean-but-every-test-skipped", "clean-but-no-test-report", "errors", "refused", "no-summary",
        "run-failed"])
def test_compute_sanitizer_results(tmp_path, output, returncode, junit, expected):
    """0 errors over tests that were all skipped checked nothing: not a pass."""
    if junit:
        (tmp_path / "junit.xml").write_text(junit)
    assert verdicts.sanitizer_verdict(Run(returncode, 1.0, output, scratch=str(tmp_path))).status == expected


def bandwidth_run(tmp_path, push_over_add, gpus=1, pull_over_peer=None):
    """Rows as benchmarks/gpu_transport.py writes them: the best block count reaches ``push_over_add``."""
    rows = []
    for mib in (16, 64, 256):
        for blocks, share in (("auto", 1.0), (132, 0.5)):
            rows.append({"mib": mib, "copy_gbps": 2000.0, "peer_copy_gbps": 400.0 if gpus > 1 else None,
                         "pull_gbps": 400.0 * (pull_over_peer or 1.0) if gpus > 1 else 1900.0, "push_blocks": blocks,
                         "add_fp32_s": 1.0, "add_bf16_s": 1.0, "push_fp32_s": 1.0 / (push_over_add * share),
                         "push_bf16_s": 1.0, "push_fp32_gbps": 1.0, "add_fp32_gbps": 1.0})
    (tmp_path / "bandwidth.json").write_text(json.dumps({"device": "H100", "gpus": gpus, "command": "c", "rows": rows,
                                                         "gemm": [], "own_gemm": None}))
    return Run(0, 1.0, "", scratch=str(tmp_path))


def test_push_is_held_against_a_local_add_and_pull_is_not_measurable_on_one_gpu(tmp_path):
    """A push moves what acc.add_(grad) moves (a copy moves 2/3 of it, so push/copy could
    never reach 80%); on one GPU a pull is a device-to-device copy, so its ratio is not measured."""
    verdict = verdicts.bandwidth_verdict(bandwidth_run(tmp_path, push_over_add=0.85))
    assert verdict.status == Status.PASS and verdict.figures["push_over_add"] == pytest.approx(0.85)
    assert verdict.figures["by_size"]["64"]["blocks"] == "auto"
    assert verdict.figures["pull_over_copy"].startswith("not measurable on one GPU")
    verdict = verdicts.bandwidth_verdict(bandwidth_run(tmp_path, push_over_add=0.7))
    assert verdict.status == Status.FAIL and verdict.error.startswith("push reaches 70% of a local add")
    two = verdicts.bandwidth_verdict(bandwidth_run(tmp_path, push_over_add=0.9, gpus=2, pull_over_peer=0.5))
    assert two.status == Status.FAIL and "pull reaches 50% of a peer copy" in two.error


def overlap_run(tmp_path, timing="cuda-events", ratio=1.02, pull=0.9, push=0.85, pull_busy=2.0):
    data = {"timing": timing, "timeline_over_host": ratio, "pull": {"busy_s": pull_busy, "hidden_fraction": pull},
            "push": {"busy_s": 1.0, "hidden_fraction": push}}
    (tmp_path / "overlap.json").write_text(json.dumps(data))
    return Run(0, 1.0, "", scratch=str(tmp_path))


def test_the_overlap_verdict_needs_a_sound_timeline_and_meets_the_target(tmp_path):
    """The verdict passed whatever came out (a timeline of 32 s for a 21 s run)."""
    assert verdicts.overlap_verdict(overlap_run(tmp_path)).status == Status.PASS
    wrong = verdicts.overlap_verdict(overlap_run(tmp_path, ratio=32 / 21))
    assert wrong.status == Status.FAIL and "not sound" in wrong.error and "1.52x" in wrong.error
    assert verdicts.overlap_verdict(overlap_run(tmp_path, pull_busy=0.0)).status == Status.FAIL
    assert verdicts.overlap_verdict(overlap_run(tmp_path, push=1.3)).status == Status.FAIL
    short = verdicts.overlap_verdict(overlap_run(tmp_path, push=0.5))
    assert short.status == Status.FAIL and "push: 50% hidden (target 80%)" in short.error
    assert verdicts.overlap_verdict(overlap_run(tmp_path, timing="host")).status == Status.INCONCLUSIVE


def split_memory_run(tmp_path, whole=1000.0, split2=(540.0, 530.0), split4=(300.0, 290.0, 295.0, 299.0),
                     cuda=True):
    key = "cuda_fwd_bwd_peak_mb" if cuda else "fwd_bwd_peak_mb"
    rows = [{"case": "whole", key: [whole, 0.0]}, {"case": "split-2", key: list(split2)},
            {"case": "split-4", key: list(split4)}]
    (tmp_path / "split_memory.json").write_text(json.dumps(rows))
    return Run(0, 1.0, "", scratch=str(tmp_path))


def test_the_split_memory_verdict_holds_the_largest_member_to_its_share_of_the_whole_sample(tmp_path):
    passed = verdicts.split_memory_verdict(split_memory_run(tmp_path))
    assert passed.status == Status.PASS and passed.figures["split-2_ratio"] == 0.54
    heavy = verdicts.split_memory_verdict(split_memory_run(tmp_path, split4=(300.0, 400.0, 295.0, 299.0)))
    assert heavy.status == Status.FAIL and "split-4 <= 0.35" in heavy.error  # one member at 40% of the whole
    assert verdicts.split_memory_verdict(split_memory_run(tmp_path, cuda=False)).status == Status.INCONCLUSIVE


def test_a_jit_item_that_compiled_nothing_fails():
    """The operator was already in the folder, and the item passed."""
    figures = {"problems": [], "ops": {"ds_odc_cuda_ipc": {"required": True, "cached_before": True, "build_s": 0.1,
                                                           "directory": "d", "compiled": False}}}
    verdict = verdicts.jit_verdict(Run(0, 1.0, "JIT_PROBE " + json.dumps(figures)))
    assert verdict.status == Status.FAIL and "nothing was compiled" in verdict.error
    figures["ops"]["ds_odc_cuda_ipc"].update(cached_before=False, compiled=True, build_s=31.0)
    verdict = verdicts.jit_verdict(Run(0, 1.0, "JIT_PROBE " + json.dumps(figures)))
    assert verdict.status == Status.PASS and "compiled in 31.0 s" in verdict.said


def test_gemm_slowdown_target():
    rows = [{"traffic": "pull", "alone_s": 1.0, "busy_s": 1.01}, {"traffic": "push", "alone_s": 1.0, "busy_s": 1.05}]
    verdict = verdicts.gemm_verdict({"gemm": rows})
    assert verdict.status == Status.FAIL and "push: +5.0%" in verdict.error
    assert verdicts.gemm_verdict({"gemm": rows[:1]}).status == Status.PASS


def test_a_carried_wheel_that_differs_from_its_manifest_is_named(tmp_path):
    from gpu_validation.install import check_manifest

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"payload")
    (tmp_path / "MANIFEST.json").write_text(json.dumps({"commit": "abc", "wheels": [
        {"file": "a-1.0-py3-none-any.whl", "bytes": 7, "sha256": "0" * 64}]}))
    with pytest.raises(SystemExit, match="a broken copy"):
        check_manifest(str(wheels))


# -- the machine, the operator, the item lists --------------------------------------------------------
def smi(rows):
    return lambda argv: (0, "\n".join(", ".join(row) for row in rows))


def test_compute_mode_and_mig_are_read_and_exclusive_mode_makes_shared_gpu_items_not_measurable():
    """In Exclusive_Process mode several ranks cannot share the GPU; say so, never fail."""
    from gpu_validation import environment, items

    view = environment.nvidia_smi_view(smi([["NVIDIA H100 80GB HBM3", "580.159.04", "81559 MiB", "Exclusive_Process",
                                             "Disabled"]]))
    assert view["driver"] == "580.159.04" and view["compute_modes"] == ["Exclusive_Process"]
    assert view["mig"] == ["Disabled"]
    machine = {**view, "gpus": 1, "mps": False}
    machine["sharing"] = environment.sharing(machine)
    assert machine["sharing"]["shared"] is False and "Exclusive_Process" in machine["sharing"]["why"]
    ctx = items.Context("/repo", "/work", "python3", "", "/kit/ops", cpu_smoke=False, machine=machine)
    by_name = {item.name: item for item in items.first(ctx) + items.second(ctx)}
    assert "Exclusive_Process" in by_name["conformance-core"].unavailable
    assert "Exclusive_Process" in by_name["overlap"].unavailable
    assert by_name["kernel-sweep"].unavailable == "" and by_name["smoke"].unavailable == ""  # one process each
    default = {**machine, "compute_modes": ["Default"], "mig": ["Enabled"]}
    default["sharing"] = environment.sharing(default)
    ctx = items.Context("/repo", "/work", "python3", "", "/kit/ops", cpu_smoke=False, machine=default)
    by_name = {item.name: item for item in items.first(ctx)}
    assert by_name["conformance-core"].unavailable == "" and "MIG" in by_name["bandwidth"].note


def test_ranks_time_sliced_on_one_gpu_are_said_to_be(tmp_path):
    """Without MPS a pass of concurrent pushes on one GPU does not show concurrency."""
    from gpu_validation import items

    machine = {"gpus": 1, "sharing": {"shared": True, "why": "", "time_sliced": True, "mig": False}}
    ctx = items.Context("/repo", "/work", "python3", "", "/kit/ops", cpu_smoke=False, machine=machine)
    core = next(item for item in items.first(ctx) if item.name == "conformance-core")
    assert "time-slices" in core.note and "not pushes executing concurrently" in core.note
    machine["sharing"]["time_sliced"] = False  # MPS
    core = next(item for item in items.first(ctx) if item.name == "conformance-core")
    assert core.note == ""


def test_the_first_command_runs_in_the_order_of_what_it_tells_and_no_item_may_hang_long():
    from gpu_validation import items

    machine = {"gpus": 1, "sharing": {"shared": True, "why": "", "time_sliced": True, "mig": False},
               "compute_sanitizer": "/usr/local/cuda/bin/compute-sanitizer"}
    ctx = items.Context("/repo", "/work", "python3", "", "/kit/ops", cpu_smoke=False, machine=machine)
    first, second = items.first(ctx), items.second(ctx)
    assert [i.name for i in items.preamble(ctx) + first] == [
        "setup", "cuda-op", "kernel-sweep", "smoke", "conformance-core", "conformance-edges", "parity-2-fp32",
        "parity-4-bf16-token", "fault-push", "bandwidth", "overlap"]
    assert "harness" not in [i.name for i in first + second]  # CPU forkserver plumbing: CI's, not the device's
    every = [items.machine_item(ctx)] + items.preamble(ctx) + first + second
    assert max(i.timeout_s for i in every) <= items.HANG_S == 90
    assert sum(i.expect_s for i in every if i in first or i.required) <= 330
    for item in every:  # every pytest item imports the installed wheel, from the copy of the tests
        if item.command and "pytest" in item.command:
            assert item.cwd == ctx.suite and "kit_installed_check" in item.command, item.name
            assert item.env["ODC_KIT_SITE"] == ctx.site and item.env["PYTHONPATH"].startswith(ctx.site)
    assert [i.name for i in items.select(first + second, ["bandwidth", "nccl-one-rank"])] == ["bandwidth",
                                                                                               "nccl-one-rank"]
    with pytest.raises(SystemExit, match="no item named"):
        items.select(first, ["harness"])


def test_the_prebuilt_operator_is_used_only_when_its_fingerprint_matches(tmp_path):
    """scripts/gpu_validation/cuda_op.py: every field that differs is named; a matching one is used."""
    import hashlib

    from gpu_validation.cuda_op import mismatch

    library = tmp_path / "ds_odc_cuda_ipc.so"
    library.write_bytes(b"\x7fELF built here")
    prebuilt = {"sources": "abc", "torch_tag": "py312_torch2.11.0_cu130", "archs": ["8.0", "9.0"],
                "sha256": hashlib.sha256(library.read_bytes()).hexdigest()}
    here = {"sources": "abc", "torch_tag": "py312_torch2.11.0_cu130", "arch": "9.0"}
    assert mismatch(prebuilt, str(library), here) == []
    found = mismatch(prebuilt, str(library), {**here, "sources": "def", "arch": "10.0"})
    assert any("sources: prebuilt abc, here def" in f for f in found) and any("10.0" in f for f in found)
    library.write_bytes(b"truncated")
    assert any("sha256 differs" in f for f in mismatch(prebuilt, str(library), here))


def test_the_command_line():
    import gpu_validate

    assert gpu_validate.parse_args(["--out", "x"]).wheels.endswith(".gpu_kit/wheels")
    assert gpu_validate.parse_args(["--out", "x"]).prebuilt.endswith(".gpu_kit/ops")
    assert gpu_validate.parse_args(["--cpu-smoke", "--out", "x"]).wheels is None
    args = gpu_validate.parse_args(["--second", "--budget", "200", "--only", "smoke", "jit-build", "--out", "x"])
    assert args.second and args.budget == 200 and args.only == ["smoke", "jit-build"]
    with pytest.raises(SystemExit):
        gpu_validate.parse_args([])  # no --out
    assert gpu_validate.FIRST_BUDGET_S == 330 and gpu_validate.SECOND_BUDGET_S <= 300


# -- the nvshmem item ----------------------------------------------------------------------------------
NVSHMEM_PROBE = os.path.join(ROOT, "scripts", "gpu_validation", "nvshmem_probe.py")


def gpu_ctx(**machine):
    from gpu_validation import items

    machine = {"gpus": 1, "sharing": {"shared": True, "why": "", "time_sliced": True, "mig": False}, **machine}
    return items.Context("/repo", "/work", "python3", "", "/kit/ops", cpu_smoke=False, machine=machine)


def test_the_nvshmem_item_is_declared_in_the_second_command_with_its_own_folder_of_wheels():
    """Before the examples and the two slow checks; only it has the NVSHMEM wheels' folder on PYTHONPATH; a CPU run
    does not start it; nothing in ds_odc imports nvshmem."""
    from gpu_validation import items

    ctx = gpu_ctx()
    names = [i.name for i in items.second(ctx)]
    assert names[-4:] == ["nvshmem", "examples", "jit-build", "memcheck-kernel-sweep"]
    assert "nvshmem" not in [i.name for i in items.first(ctx)]
    item = next(i for i in items.second(ctx) if i.name == "nvshmem")
    assert item.command[1] == NVSHMEM_PROBE and item.command[2:] == ["--elements", str(64 << 20)]
    assert item.env["PYTHONPATH"].split(os.pathsep)[:2] == ["/work/site-nvshmem", "/work/site"]
    assert item.cwd == "/work" and item.timeout_s <= items.HANG_S and item.unavailable == ""
    assert item.interpret is verdicts.nvshmem_verdict
    others = [i for i in items.preamble(ctx) + items.first(ctx) + items.second(ctx) if i.name != "nvshmem"]
    assert all("site-nvshmem" not in i.env.get("PYTHONPATH", "") for i in others)
    setup = items.setup_item(ctx).command
    assert setup[setup.index("--nvshmem-site") + 1] == "/work/site-nvshmem"
    smoke = items.Context("/repo", "/work", "python3", "", "/kit/ops", cpu_smoke=True)
    cpu = next(i for i in items.second(smoke) if i.name == "nvshmem")
    assert "a GPU run only" in cpu.unavailable
    assert "no CUDA GPU" in next(i for i in items.second(gpu_ctx(gpus=0)) if i.name == "nvshmem").unavailable
    with pytest.raises(SystemExit):  # --only finds it by name
        items.select(items.second(ctx), ["nvshem"])
    assert [i.name for i in items.select(items.second(ctx), ["nvshmem"])] == ["nvshmem"]
    import re
    importing = re.compile(r"^\s*(import|from)\s+nvshmem\b|import_module\(\s*[\"']nvshmem", re.M)
    package = os.path.join(ROOT, "ds_odc")
    sources = [os.path.join(d, f) for d, _, files in os.walk(package) for f in files if f.endswith(".py")]
    assert sources and [f for f in sources if importing.search(open(f).read())] == []


def test_without_nvshmem4py_the_probe_says_not_measurable_and_the_phase_records_it(tmp_path):
    """Here (no nvshmem4py, no GPU) the probe exits 0 with the reason; run as an item, results.json holds the
    verdict not_measurable, the reason as the error and the probe's figures."""
    phase = Phase("second command", str(tmp_path / "out"), str(tmp_path / "work"), budget_s=60, header={})
    env = {"PYTHONPATH": "", "DS_ACCELERATOR": "cpu"}
    result = phase.run(Item("nvshmem", "nvshmem4py on one PE", [PY, NVSHMEM_PROBE, "--elements", "1024"], 60,
                            verdicts.nvshmem_verdict, env, str(tmp_path), expect_s=1))
    assert result.status == Status.NOT_MEASURABLE, result.error
    assert "nvshmem4py is not installed here" in result.error and result.figures["elements"] == 1024
    phase.finish()
    with open(tmp_path / "out" / "results.json") as handle:
        recorded = {item["name"]: item for item in json.load(handle)["items"]}["nvshmem"]
    assert recorded["status"] == "not_measurable" and "not installed" in recorded["error"]
    assert set(recorded) >= {"name", "title", "status", "seconds", "figures", "error", "command"}


NVSHMEM_PASSED = {"elements": 64 << 20, "nvshmem4py": "0.4.1", "libnvshmem": "3.4.5", "n_pes": 1, "my_pe": 0,
                  "peer": 0, "finalized": True, "problems": [],
                  "get": {"bytes_equal": True, "gbps": 1500.0, "ms": 0.09, "over_torch_copy": 0.9},
                  "put": {"bytes_equal": True, "gbps": 1400.0, "ms": 0.1, "over_torch_copy": 0.85},
                  "torch_copy": {"gbps": 1600.0, "ms": 0.08},
                  "accumulate": {"exact": True, "max_abs_diff": 0.0, "gbps": 3000.0, "ms": 0.2}}


@pytest.mark.parametrize("change,returncode,expected,words", [
    ({}, 0, Status.PASS, "get 1500.0 GB/s"),
    ({"problems": ["get_nbi from PE 0: the bytes differ from that PE's window"]}, 1, Status.FAIL, "bytes differ"),
    ({"finalized": False}, 0, Status.FAIL, "not finalized"),
    ({"not_measurable": "no CUDA device is visible"}, 0, Status.NOT_MEASURABLE, "no CUDA device"),
], ids=["passed", "bytes-differ", "not-finalized", "no-gpu"])
def test_the_nvshmem_verdict(change, returncode, expected, words):
    figures = {**NVSHMEM_PASSED, **change}
    output = 'NVSHMEM_STAGE {"stage": "initialized"}\nNVSHMEM ' + json.dumps(figures) + "\n"
    verdict = verdicts.nvshmem_verdict(Run(returncode, 1.0, output))
    assert verdict.status == expected
    assert words in (verdict.said if expected == Status.PASS else verdict.error)
    crashed = verdicts.nvshmem_verdict(Run(-11, 1.0, 'NVSHMEM_STAGE {"stage": "process group"}\nSegmentation fault'))
    assert crashed.status == Status.FAIL and "printed no result" in crashed.error and "process group" in crashed.error


def test_the_nvshmem_probe_s_pieces_without_nvshmem(tmp_path):
    """The unique id's bytes travel from rank 0 into every rank's empty id; the carried library is found on
    sys.path; NVSHMEM settings the caller made are kept."""
    import numpy as np

    sys.path.insert(0, os.path.join(ROOT, "scripts", "gpu_validation"))
    try:
        import nvshmem_probe
    finally:
        sys.path.pop(0)
    layout = np.dtype([("version", np.int32), ("internal", np.int8, (124,))], align=True)

    class Uid:  # nvshmem4py's uniqueid: a one-struct recarray in _data
        def __init__(self, fill=None):
            self._data = np.zeros(1, dtype=layout).view(np.recarray)
            if fill is not None:
                self._data.version, self._data.internal = 3, np.arange(124) % 100

    class Dist:
        def __init__(self):
            self.sent = None

        def broadcast_object_list(self, box, src):
            assert src == 0
            if box[0] is not None:
                self.sent = box[0]
            box[0] = self.sent

    dist = Dist()
    made = nvshmem_probe.broadcast_uid(dist, 0, lambda: Uid(fill=True), Uid)
    other = nvshmem_probe.broadcast_uid(dist, 1, lambda: pytest.fail("only rank 0 makes the id"), Uid)
    assert len(dist.sent) == 128 and nvshmem_probe.uid_bytes(other) == nvshmem_probe.uid_bytes(made)
    assert other._data.version[0] == 3 and list(other._data.internal[0][:3]) == [0, 1, 2]
    with pytest.raises(ValueError):
        nvshmem_probe.load_uid(Uid(), b"short")
    library = tmp_path / nvshmem_probe.HOST_LIBRARY
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    assert nvshmem_probe.find_host_library([str(tmp_path / "x"), str(tmp_path)]) == str(library)
    assert nvshmem_probe.find_host_library([str(tmp_path / "x")]) is None
    one = nvshmem_probe.nvshmem_environment(1, 640 << 20, environ={"NVSHMEM_REMOTE_TRANSPORT": "ibrc"})
    assert one["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "lo" and "NVSHMEM_REMOTE_TRANSPORT" not in one
    assert int(one["NVSHMEM_SYMMETRIC_SIZE"]) > 640 << 20
    assert set(nvshmem_probe.nvshmem_environment(4, 1 << 20, environ={})) == {"NVSHMEM_SYMMETRIC_SIZE"}


def test_the_nvshmem_wheels_are_installed_apart():
    from gpu_validation.install import split_carried

    carried = ["/k/deepspeed-0.19.8-py3-none-any.whl", "/k/nvshmem4py_cu13-0.4.1-cp312-cp312-x.whl",
               "/k/cuda_core-1.2.2-cp312-cp312-x.whl", "/k/cuda_bindings-13.5.0-cp312-cp312-x.whl",
               "/k/cuda_pathfinder-1.9.1-py3-none-any.whl", "/k/pydantic-2.0-py3-none-any.whl",
               "/k/nvidia_nvshmem_cu13-3.4.5-py3-none-x.whl"]
    general, nvshmem = split_carried(carried)
    assert [os.path.basename(w).split("-")[0] for w in general] == ["deepspeed", "pydantic"]
    assert len(nvshmem) == 5
