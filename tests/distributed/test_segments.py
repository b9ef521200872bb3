"""Segments, lock files and the orphan sweep, with real processes but no process group: a reservation
that does not fit fails up front, a life lock tells a live owner from a dead one, a signal during
allocation removes the rank's files, and the sweep removes dead ranks' files only."""
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from ds_odc.comm.locks import LockFile, holds_life_lock
from ds_odc.comm.segments import SegmentSpaceError, create_reserved, segment_path, sweep_orphans

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _python(code: str, *args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


HOLD_LOCK = """
import sys, time
from ds_odc.comm.locks import LockFile
LockFile.create(sys.argv[1], 0, 1.0)
print("locked", flush=True)
time.sleep(120)
"""


@pytest.fixture
def directory(tmp_path):
    return str(tmp_path)


def test_a_reservation_that_does_not_fit_fails_at_once_and_leaves_nothing():
    target = tempfile.mkdtemp(prefix="odc_tiny_")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", target], capture_output=True)
    if mounted.returncode != 0:
        os.rmdir(target)
        pytest.skip("cannot mount a tmpfs here")
    try:
        path = os.path.join(target, "ds_odc_ab12_r0_params")
        with pytest.raises(SegmentSpaceError) as info:
            create_reserved(path, 4 << 20)
        assert info.value.nbytes == 4 << 20 and info.value.path == path
        assert os.listdir(target) == []
        create_reserved(path, 512 << 10)  # what fits is reserved: every page is there now
        assert os.stat(path).st_blocks * 512 >= 512 << 10
    finally:
        subprocess.run(["umount", target], check=True)
        os.rmdir(target)


def test_the_life_lock_tells_a_live_owner_from_a_dead_one(directory):
    path = os.path.join(directory, "ds_odc_ab12_r1_lock")
    owner = _python(HOLD_LOCK, path)
    assert owner.stdout.readline().strip() == "locked"
    peer = LockFile.open(path, 1, 1.0)
    assert peer.owner_alive() and peer.owner_alive()  # testing does not take the lock away
    owner.kill()
    owner.wait()
    assert not peer.owner_alive()
    peer.close()


def test_a_lock_file_is_locked_before_it_is_visible(directory):
    path = os.path.join(directory, "ds_odc_ab12_r0_lock")
    holder = _python(HOLD_LOCK, path)
    deadline = time.monotonic() + 30
    while not os.path.exists(path):  # the moment the final name exists, its life lock is held
        assert time.monotonic() < deadline
    fd = os.open(path, os.O_RDWR)
    try:
        assert holds_life_lock(fd)
    finally:
        os.close(fd)
        holder.kill()
        holder.wait()


def test_sweep_removes_dead_ranks_files_only(directory):
    def files(session, rank, kinds):
        paths = []
        for kind in kinds:
            paths.append(segment_path(directory, session, rank, kind))
            open(paths[-1], "w").close()
        return paths

    live_lock = segment_path(directory, "aaaa", 0, "lock")
    live = _python(HOLD_LOCK, live_lock)
    assert live.stdout.readline().strip() == "locked"
    live_files = files("aaaa", 0, ["ctrl", "params"]) + [live_lock]
    dead = files("bbbb", 0, ["lock", "ctrl", "params", "grads"])  # nobody holds its life lock
    lockless = files("cccc", 1, ["ctrl"])  # its lock file is created first and removed last: gone
    young_temporary = files("dddd", 0, ["lock.creating"])  # a rank between create and rename
    unrelated = os.path.join(directory, "someone_elses_file")
    open(unrelated, "w").close()
    try:
        removed = sweep_orphans(directory)
        assert sorted(removed) == sorted(dead + lockless)
        assert all(os.path.exists(p) for p in live_files + young_temporary + [unrelated])
    finally:
        live.kill()
        live.wait()
    assert sorted(sweep_orphans(directory)) == sorted(live_files)


SIGNAL_WHILE_ALLOCATING = """
import os, signal, sys
from ds_odc.comm.segments import CleanupOnSignal, create_reserved
path, name, disposition = sys.argv[1:]
# the disposition this test is about, whatever the one inherited (a background job ignores SIGINT)
signal.signal(getattr(signal, name), {"python": signal.default_int_handler, "default": signal.SIG_DFL,
                                       "ignored": signal.SIG_IGN}[disposition])
with CleanupOnSignal() as guard:
    guard.track([path])
    create_reserved(path, 1 << 20)
    print("created", flush=True)
    os.kill(os.getpid(), getattr(signal, name))
    for _ in range(100):
        pass
print("survived", flush=True)
"""


@pytest.mark.parametrize("name,disposition,expected", [
    ("SIGTERM", "default", -signal.SIGTERM), ("SIGHUP", "default", -signal.SIGHUP),
    ("SIGINT", "python", -signal.SIGINT), ("SIGTERM", "ignored", 0)])
def test_a_signal_while_allocating_removes_the_files_then_acts_as_before(directory, name, disposition, expected):
    path = os.path.join(directory, "ds_odc_ab12_r0_params")
    process = _python(SIGNAL_WHILE_ALLOCATING, path, name, disposition)
    out, err = process.communicate(timeout=60)
    assert process.returncode == expected, (process.returncode, out, err)
    if disposition == "ignored":  # the process goes on, and so must its files
        assert "survived" in out and os.path.exists(path)
        return
    assert "created" in out and "survived" not in out, (out, err)
    if name == "SIGINT":  # Python's own handler ran: KeyboardInterrupt, and the exit status of SIGINT
        assert "KeyboardInterrupt" in err
    assert not os.path.exists(path)
