"""Asking for the odc stage without ``"stage": "odc"``: the marker form (an odc block next to stage 3) and
the environment switch (``DS_ODC_STAGE3=odc``, options in ``DS_ODC_OPTIONS``), through a framework-shaped
script that builds its config in code and branches on ``stage == 3``; ranks that disagree; what
accelerate reads from ``ACCELERATE_DEEPSPEED_ZERO_STAGE=odc``; and the DeepSpeed launcher carrying the
switch to other nodes."""
import json
import os
import subprocess
import sys

import pytest

from tests.support.compare import worst_rel_diff
from tests.support.config_route_workloads import caller_accumulated_training, framework_training, initialize_outcome
from tests.support.harness import run_ranks
from tests.support.workloads import reference_training

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWITCH = {"DS_ODC_STAGE3": "odc", "DS_ODC_OPTIONS": json.dumps({"accumulator_dtype": "fp64"})}
UNEVEN = (3, 1)


@pytest.mark.parametrize("route", ["marker", "switch"])
def test_a_framework_built_stage_3_config_trains_on_odc_with_uneven_counts_as_one_process(route):
    """The framework's stage stays 3 in its own dict and in every branch it takes; its engine is an ODC one,
    and ranks running 3 and 1 micro-batches a step give one process's update on the global batch."""
    odc_block = {"accumulator_dtype": "fp64"} if route == "marker" else None
    env = SWITCH if route == "switch" else None
    results = run_ranks(framework_training, 2, UNEVEN, odc_block, 3, env)
    expected = reference_training("managed", UNEVEN)
    for result in results:
        assert result["engine"] == "ODCEngine" and result["stage_in_config"] == 3, result["engine"]
        assert result["branches"] == ["zero.Init", "16-bit save path"]
        assert worst_rel_diff(result["params"], expected) <= 1e-5


def test_several_backward_calls_per_step_with_gas_1_give_zero3s_update_through_the_switch():
    """OpenRLHF's loop (GAS 1, three backward calls with caller-scaled losses, one step) switched by the
    environment alone: the same update as on ZeRO-3 (which sums the calls), not a third of it."""
    on_odc = run_ranks(caller_accumulated_training, 2, (3, 3), 2, SWITCH)
    on_zero3 = run_ranks(caller_accumulated_training, 2, (3, 3), 2, None)
    assert [r["engine"] for r in on_odc + on_zero3] == ["ODCEngine"] * 2 + ["DeepSpeedEngine"] * 2
    assert worst_rel_diff(on_odc[0]["params"], on_zero3[0]["params"]) <= 1e-5


def test_the_switch_off_leaves_a_stage_3_config_on_zero3():
    results = run_ranks(framework_training, 2, (2, 2), None, 1, {"DS_ODC_STAGE3": "0"})
    assert [r["engine"] for r in results] == ["DeepSpeedEngine", "DeepSpeedEngine"]


def test_ranks_that_disagree_on_the_switch_are_named_before_any_collective():
    """Rank 0 asks for ODC through the switch, rank 1 does not (its node lacks the variable): rank 0 names
    rank 1 when its bound runs out, instead of meeting rank 1 in a different collective."""
    asks = dict(SWITCH, DS_ODC_OPTIONS='{"timeout_s": 3}')
    report = run_ranks(initialize_outcome, 2, [asks, {"DS_ODC_STAGE3": ""}], report=True, wait_for=[0], timeout=90,
                       pg_timeout_s=30)
    status, outcome = report.outcomes[0]
    assert status == "ok" and outcome["error"] == "ODCConfigError", outcome
    assert "ranks [1] did not" in outcome["message"] and "DS_ODC_STAGE3" in outcome["message"], outcome
    assert outcome["waited_s"] < 3 + 15, outcome


def test_ranks_with_different_options_through_the_switch_are_named():
    other = dict(SWITCH, DS_ODC_OPTIONS='{"accumulator_dtype": "fp32"}')
    report = run_ranks(initialize_outcome, 2, [SWITCH, other], report=True, timeout=90, pg_timeout_s=30)
    for rank in (0, 1):
        status, outcome = report.outcomes[rank]
        assert status == "ok" and outcome["error"] == "ODCConfigError", outcome
        assert f"rank {1 - rank} asked for the odc stage with another environment switch" in outcome["message"]


def _python(code, **env):
    full = {**{k: v for k, v in os.environ.items() if not k.startswith(("DS_ODC_", "ACCELERATE_"))},
            "DS_ACCELERATOR": "cpu", **env}
    done = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_accelerate_reads_accelerate_deepspeed_zero_stage_odc_as_stage_3_on_odc():
    """What axolotl exports: accelerate's plugin gets stage 3 (it calls int() on the variable), and the config
    it builds in code reaches DeepSpeed as an odc one (the canonical form), so its engines run on ODC."""
    code = ("import json, os; from accelerate.utils import DeepSpeedPlugin; p = DeepSpeedPlugin(); "
            "c = p.deepspeed_config; print(json.dumps([p.zero_stage, c['zero_optimization']['stage'], 'odc' in c, "
            "os.environ['DS_ODC_STAGE3']]))")
    assert json.loads(_python(code, ACCELERATE_DEEPSPEED_ZERO_STAGE="odc")) == [3, 3, True, "odc"]
    assert json.loads(_python(code.replace("os.environ['DS_ODC_STAGE3']", "os.environ.get('DS_ODC_STAGE3')"),
                              ACCELERATE_DEEPSPEED_ZERO_STAGE="3")) == [3, 3, False, None]


def test_the_report_shows_the_switch():
    code = "from ds_odc.report import collect; print(collect()['environment']['stage-3 engines on odc'])"
    assert _python(code, DS_ODC_STAGE3="odc", DS_ODC_OPTIONS='{"timeout_s": 9}') == \
        'yes, every one (DS_ODC_STAGE3=odc; DS_ODC_OPTIONS {"timeout_s": 9})'
    assert _python(code).startswith("no (DS_ODC_STAGE3 unset")


def test_the_deepspeed_launcher_exports_the_switch_to_the_other_nodes(tmp_path):
    """A two-node hostfile through pdsh: the command the launcher hands pdsh exports DS_ODC_STAGE3 and
    DS_ODC_OPTIONS (a stand-in pdsh records it instead of reaching the nodes)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "pdsh_argv.json"
    pdsh = bin_dir / "pdsh"
    pdsh.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv, open({str(record)!r}, 'w'))\n")
    pdsh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "DS_ACCELERATOR": "cpu", **SWITCH}
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--hostfile", str(hostfile),
                           "--no_ssh_check", "--master_addr", "127.0.0.1", "train.py"],
                          env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path))
    assert record.exists(), done.stdout[-2000:] + done.stderr[-2000:]
    command = " ".join(json.loads(record.read_text()))
    assert "export DS_ODC_STAGE3=odc" in command and "export DS_ODC_OPTIONS=" in command, command
