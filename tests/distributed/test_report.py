"""``python -m ds_odc report`` tells versions, transports and operators, and builds nothing."""
import json
import os
import subprocess
import sys

import deepspeed
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args):
    done = subprocess.run([sys.executable, "-m", "ds_odc", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def report():
    from ds_odc.ops_builder import OPS, build_directory

    built_before = {spec.name: build_directory(spec).exists() for spec in OPS}
    text, data = _run("report"), json.loads(_run("report", "--json"))
    for spec in OPS:
        if not built_before[spec.name]:
            assert not build_directory(spec).exists(), f"the report built {spec.name}"
    return text, data


def test_report_names_the_versions_of_everything_ds_odc_runs_with(report):
    text, data = report
    import ds_odc

    assert data["versions"]["ds_odc"].startswith(ds_odc.__version__)
    assert data["versions"]["torch"].startswith(torch.__version__)
    assert data["versions"]["deepspeed"] == f"{deepspeed.__version__} (in the tested range, 0.18.0 to 0.19.8)"
    for package in ("transformers", "accelerate"):
        assert package in data["versions"]
        assert f"{package} " in text
    assert f"deepspeed ............. {deepspeed.__version__} (in the tested range" in text


@pytest.mark.parametrize("package, version, inside", [
    ("deepspeed", "0.18.0", True), ("deepspeed", "0.19.8+cu130", True), ("deepspeed", "0.17.6", False),
    ("transformers", "4.57.1", True), ("transformers", "5.23.0", True), ("transformers", "4.56.2", False),
    ("transformers", "5.24.0", False), ("accelerate", "1.11.0", True), ("accelerate", "1.16.0", False),
])
def test_report_says_whether_each_release_is_in_the_tested_range(package, version, inside):
    from ds_odc.report import range_note

    note = range_note(package, version)
    assert note.startswith("in the tested range" if inside else "OUTSIDE the tested range"), note
    if not inside:
        assert ("refused at import" if package == "deepspeed" else "warns") in note


def test_report_says_which_transports_work_here_and_why(report):
    text, data = report
    shm_ok, shm_reason = data["transports"]["shm"]
    assert shm_ok == os.access("/dev/shm", os.W_OK), shm_reason
    assert shm_reason
    for name, (ok, reason) in data["transports"].items():
        assert ok or reason, f"transport {name} unavailable without a reason"
        assert f"{name} " in text and ("[OKAY]" if ok else "[NO]") in text


def test_report_lists_every_compiled_operator_with_its_state(report):
    from ds_odc.ops_builder import op_status

    text, data = report
    assert [op["name"] for op in data["ops"]] == [op["name"] for op in op_status()]
    for op in data["ops"]:
        assert op["name"] in text
        if not op["built"] and not op["buildable"]:
            assert op["reason"] and op["reason"] in text


def test_report_says_how_control_words_are_ordered(report):
    text, data = report
    usable, description = data["control plane"]["memory ordering"]
    assert usable and ("release/acquire" in description or "TSO" in description), description
    assert "memory ordering" in text and description in text


def test_report_shows_the_topology_a_launcher_announces():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    done = subprocess.run([sys.executable, "-m", "ds_odc", "report", "--json"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    rows = json.loads(done.stdout)["topology"]
    assert rows["launcher"] == "2 nodes x 2 ranks (node0: ranks 0-1; node1: ranks 2-3)"
    assert rows["odc"].startswith("several nodes: windows and accumulators over the 2 ranks of a node")
    assert "optimizer state over all 4" in rows["odc"] and "one exchange per step" in rows["odc"]


def test_the_report_exits_0_here_and_says_so(report):
    text, data = report
    assert data["out_of_range"] == []
    assert text.rstrip().endswith("everything checked is in range")


def test_version_at_the_top_level_and_on_report():
    import ds_odc

    assert _run("--version") == _run("report", "--version") == f"ds_odc {ds_odc.__version__}\n"


def _fine() -> dict:
    """A report's data with every row in range (transports and operators as on a CPU machine)."""
    return {"versions": {"deepspeed": "0.19.8 (in the tested range, 0.18.0 to 0.19.8)", "transformers": "not installed",
                         "accelerate": "1.11.0 (in the tested range, 1.11 to 1.15)"},
            "environment": {"stage-3 engines on odc": "no (DS_ODC_STAGE3 unset)"},
            "topology": {"launcher": "none (WORLD_SIZE unset)"},
            "transports": {"shm": (True, "/dev/shm"), "cuda_ipc": (False, "torch is a CPU-only build")},
            "control plane": {"memory ordering": (True, "release/acquire")},
            "ops": [{"name": "ds_odc_cuda_ipc", "built": False, "buildable": False, "reason": "no nvcc"}]}


@pytest.mark.parametrize("section, row, value, names", [
    ("versions", "transformers", "5.24.0 (OUTSIDE the tested range, 4.57 to 5.23: the 'odc' stage warns when it "
     "patches it)", "versions: transformers: 5.24.0 (OUTSIDE"),
    ("versions", "deepspeed", "0.17.6 (OUTSIDE the tested range, 0.18.0 to 0.19.8: refused at import)",
     "versions: deepspeed: 0.17.6"),
    ("environment", "stage-3 engines on odc", "refused: DS_ODC_STAGE3='yes': set it to \"odc\"",
     "environment: stage-3 engines on odc: refused"),
    ("topology", "odc", "several nodes, refused at initialize: nodes hold different numbers of ranks",
     "topology: odc: several nodes, refused"),
    ("control plane", "memory ordering", (False, "neither the atomics operator nor x86-64"),
     "control plane: memory ordering: [NO] neither"),
])
def test_a_row_out_of_range_makes_the_report_exit_1_and_machine_facts_do_not(section, row, value, names):
    from ds_odc.report import out_of_range

    data = _fine()
    assert out_of_range(data) == []  # no cuda_ipc, an operator that cannot be built: facts of a CPU machine
    data[section][row] = value
    [found] = out_of_range(data)
    assert found.startswith(names), found
    data = _fine()
    data["transports"] = {"error": "ImportError: broken"}
    assert out_of_range(data) == ["transports: not inspected: ImportError: broken"]


def test_output_into_a_pipe_closed_early_ends_quietly():
    """``python -m ds_odc report | head``: the reader is gone before the report writes; no traceback."""
    done = subprocess.Popen([sys.executable, "-m", "ds_odc", "report"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    done.stdout.close()  # closed before the report writes a byte (importing ds_odc takes seconds)
    err = done.stderr.read().decode()
    assert done.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and err == "", err
