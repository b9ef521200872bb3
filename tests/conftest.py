import os
import pathlib

import pytest

SHM_DIR = "/dev/shm"
TESTS = pathlib.Path(__file__).resolve().parent

#: Markers given by where a test lives (registered in pytest.ini; tests/README.md says what each suite is).
#: They only label: every test still runs by default, and ``-m "not distributed"`` and the like select.
MARKERS_BY_DIRECTORY = {"distributed": "distributed", "gpu": "gpu"}
MARKERS_BY_FILE = {"test_two_hosts.py": "multi_host", "test_two_hosts_global.py": "multi_host"}


def pytest_collection_modifyitems(config, items):
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
