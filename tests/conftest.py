import os
import pathlib

import pytest

SHM_DIR = "/dev/shm"
TESTS = pathlib.Path(__file__).resolve().parent

#: Markers given by where a test lives (registered in pytest.ini; tests/README.md says what each suite is).
#: They only label: every test still runs by default, and ``-m "not distributed"`` and the like select.
MARKERS_BY_DIRECTORY = {"distributed": "distributed", "gpu": "gpu"}
MARKERS_BY_FILE = {"test_two_hosts.py": "multi_host", "test_two_hosts_global.py": "multi_host"}
#: The longest files, longest first (measured: tests/README.md). They are collected first, so that with several
#: workers (tests/workers.py) none of them starts last and leaves one worker running alone at the end.
LONGEST_FIRST = ["test_two_hosts_global.py", "test_two_hosts.py", "test_combinations.py", "test_hf_example.py",
                 "test_gpu_kit_smoke.py", "test_offload_states.py", "test_step_failures.py", "test_fault_matrix.py",
                 "test_benchmark_smoke.py", "test_split_runtime.py", "test_hf_balance.py", "test_autoload.py",
                 "test_sequence_parallel.py"]


def pytest_report_header(config):
    perturb = os.environ.get("DS_ODC_PERTURB")
    return [f"ds_odc: schedule perturbation DS_ODC_PERTURB={perturb} (every rank's protocol points delayed at random; "
            "rerun a failure with the same value)"] if perturb else []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    perturb = os.environ.get("DS_ODC_PERTURB")
    if perturb and report.failed:
        report.sections.append(("ds_odc schedule", f"failed under DS_ODC_PERTURB={perturb}: rerun with the same "
                                "value to reproduce, then pin the order with a forced-order test"))


@pytest.fixture(autouse=True, scope="session")
def perturbed_in_process():
    """Under ``DS_ODC_PERTURB``, tests whose ranks are threads of this process (tests/support/loopback.py) are
    perturbed too; spawned ranks install their own when their engine's session opens."""
    if not os.environ.get("DS_ODC_PERTURB"):
        yield
        return
    from ds_odc.comm import schedule

    perturbation = schedule.perturb_from_environment(rank=-1)
    yield
    if perturbation is not None:
        schedule.uninstall(perturbation)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(pathlib.Path(item.path).name, len(rank)))  # stable: the rest keep their order
    for item in items:
        try:
            parts = pathlib.Path(item.path).resolve().relative_to(TESTS).parts
        except ValueError:
            continue  # collected from outside tests/
        for name in (MARKERS_BY_DIRECTORY.get(parts[0]), MARKERS_BY_FILE.get(parts[-1])):
            if name is not None:
                item.add_marker(name)


def _odc_segments():
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith("ds_odc_")}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def shared_memory_is_clean():
    """Every test must leave /dev/shm as it found it: no ds_odc segment survives any exit path."""
    before = _odc_segments()
    yield
    leaked = _odc_segments() - before
    assert not leaked, f"shared-memory segments leaked: {sorted(leaked)}"
