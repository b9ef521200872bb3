"""The validation kit's orchestration (scripts/gpu_validation): timeouts that kill whole process groups,
the four verdicts, the results file and its closing line, and how each kind of output is read.
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
    phase = Phase("correctness", out, work, budget_s=60, header={"environment": {"gpus": 0}})

    def broken(run):
        raise KeyError("figure")

    items = [
        Item("ok", "exits 0", py("print('fine')"), 30),
        Item("exits-1", "exits 1", py("import sys; sys.exit(1)"), 30),
        Item("hangs", "sleeps past its timeout", py("import time; time.sleep(60)"), 2),
        Item("one-gpu", "needs two GPUs", unavailable="needs two GPUs; this machine has 1"),
        Item("derived", "read from 'ok'", derive=lambda done: Verdict(done["ok"].status, {"from": "ok"})),
        Item("unreadable", "its interpreter raises", py("pass"), 30, interpret=broken),
        Item("figures", "writes a file its interpreter reads",
             py("import json, sys; json.dump({'x': 1.5}, open(sys.argv[1], 'w'))") + ["{scratch}/f.json"], 30,
             interpret=lambda run: Verdict(Status.PASS, verdicts.read_json(run, "f.json"))),
    ]
    for item in items:
        phase.run(item)
    assert phase.finish() == 1  # something failed
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "3 passed, 3 failed"
    assert lines[-2] == "phase correctness: 1 not measurable on this machine, 0 inconclusive"
    with open(os.path.join(out, "results.json")) as handle:
        results = json.load(handle)
    statuses = {item["name"]: item["status"] for item in results["items"]}
    assert statuses == {"ok": "pass", "exits-1": "fail", "hangs": "fail", "one-gpu": "not_measurable",
                        "derived": "pass", "unreadable": "fail", "figures": "pass"}
    by_name = {item["name"]: item for item in results["items"]}
    assert "timed out after 2 s" in by_name["hangs"]["error"] and by_name["hangs"]["seconds"] < 15
    assert "exit status 1" in by_name["exits-1"]["error"]
    assert "KeyError" in by_name["unreadable"]["error"]
    assert by_name["figures"]["figures"] == {"x": 1.5} and by_name["derived"]["figures"] == {"from": "ok"}
    assert results["closing"] == "3 passed, 3 failed" and results["environment"] == {"gpus": 0}
    assert results["summary"] == {"pass": 3, "fail": 3, "not_measurable": 1, "inconclusive": 0}
    assert sorted(os.listdir(out)) == ["log.txt", "results.json"]
    log = open(os.path.join(out, "log.txt")).read()
    assert "fine" in log and all(f"{item.name}: " in log for item in items)


def test_items_past_the_phase_budget_are_inconclusive_not_failed(tmp_path):
    phase = Phase("performance", str(tmp_path / "out"), str(tmp_path / "work"), budget_s=3, header={})
    first = phase.run(Item("slow", "outlasts the phase", py("import time; time.sleep(60)"), timeout_s=60),
                      min_start_s=1)
    second = phase.run(Item("late", "starts after the budget", py("pass"), 30), min_start_s=1)
    assert first.status == Status.INCONCLUSIVE and "stopped at the phase budget" in first.error
    assert second.status == Status.INCONCLUSIVE and "budget was spent" in second.error
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
    verdict = verdicts.pytest_verdict(junit_run(tmp_path, 0))
    assert verdict.status == Status.PASS and verdict.figures["passed"] == 1 and verdict.figures["skipped"] == 1
    assert verdict.figures["skip_reasons"] == ["needs a CUDA device"]
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


@pytest.mark.parametrize("output,returncode,expected", [
    ("========= ERROR SUMMARY: 0 errors\n========= ERROR SUMMARY: 0 errors\n", 0, Status.PASS),
    ("========= Invalid __global__ write of size 4 bytes\n========= ERROR SUMMARY: 3 errors\n", 99, Status.FAIL),
    ("========= Error: Device not supported\n========= ERROR SUMMARY: 0 errors\n", 0, Status.INCONCLUSIVE),
    ("python: no such file\n", 1, Status.INCONCLUSIVE),
    ("========= ERROR SUMMARY: 0 errors\n", 1, Status.INCONCLUSIVE),
], ids=["clean", "errors", "refused", "no-summary", "run-failed"])
def test_compute_sanitizer_results(output, returncode, expected):
    assert verdicts.sanitizer_verdict(Run(returncode, 1.0, output)).status == expected


def bandwidth_run(tmp_path, pull, push):
    rows = [{"mib": mib, "copy_gbps": 1000.0, "peer_copy_gbps": None, "pull_gbps": pull * 1000, "push_blocks": blocks,
             "push_fp32_gbps": push * 1000 * blocks / 16, "push_bf16_gbps": 1.0} for mib in (16, 64, 256)
            for blocks in (8, 16)]
    (tmp_path / "bandwidth.json").write_text(json.dumps({"device": "H100", "gpus": 1, "command": "c", "rows": rows,
                                                         "gemm": [], "own_gemm": None}))
    return Run(0, 1.0, "", scratch=str(tmp_path))


def test_bandwidth_targets_at_64_mib_and_above_with_the_best_push_blocks(tmp_path):
    verdict = verdicts.bandwidth_verdict(bandwidth_run(tmp_path, pull=0.95, push=0.85))
    assert verdict.status == Status.PASS and verdict.figures["push_over_copy"] == pytest.approx(0.85)
    assert verdict.figures["by_size"]["64"]["blocks"] == 16 and "same GPU" in verdict.figures["what"]
    verdict = verdicts.bandwidth_verdict(bandwidth_run(tmp_path, pull=0.5, push=0.85))
    assert verdict.status == Status.FAIL and verdict.error.startswith("pull reaches 50% of copy bandwidth")


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


def test_the_command_line_refuses_a_performance_smoke_run():
    import gpu_validate

    with pytest.raises(SystemExit):
        gpu_validate.parse_args(["--cpu-smoke", "--phase", "performance", "--out", "x"])
    assert gpu_validate.parse_args(["--cpu-smoke", "--out", "x"]).phase == "correctness"
    assert gpu_validate.parse_args(["--phase", "performance", "--out", "x"]).wheels.endswith(".gpu_kit/wheels")
