import os

import pytest

SHM_DIR = "/dev/shm"


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
