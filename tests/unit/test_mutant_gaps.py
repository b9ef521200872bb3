"""Behaviour the rest of the suite did not pin down, found by seeding the defects of tests/mutants/ (each test
names the mutant it kills): in one process, without a process group."""
import queue
import threading

import pytest
import torch

from ds_odc.comm import remote as remote_module
from ds_odc.comm.remote import RemoteWindows
from ds_odc.comm.segments import map_segment
from ds_odc.errors import ODCPeerError
from tests.support.loopback import LoopbackGroup, runtime_for


def test_a_peer_window_that_is_not_there_is_an_error_not_a_window_of_zeros(tmp_path):
    """h29: ``torch.from_file`` would create a missing segment and map zeros; a peer's window that is gone (or
    made again under another name) must raise, and nothing may be created in its place."""
    missing = tmp_path / "ds_odc_test_missing_params"
    with pytest.raises(FileNotFoundError):
        map_segment(str(missing), 4, torch.float32)
    assert not missing.exists()
    short = tmp_path / "ds_odc_test_short_params"
    short.write_bytes(bytes(8))
    with pytest.raises(ValueError, match="holds 8 bytes, 16 expected"):
        map_segment(str(short), 4, torch.float32)


class _Sending:
    """A reply's send that leaves only when the test says so (a requester that stopped reading)."""

    def __init__(self):
        self.left = threading.Event()

    def wait(self, *args):
        self.left.wait()


def _server_side(timeout_s: float) -> RemoteWindows:
    """The server half of a RemoteWindows with no process group and no thread: what its serving thread uses
    to send replies, see them leave and end (``_send_reply``, ``_see_replies_leave``, ``_drain``)."""
    windows = RemoteWindows.__new__(RemoteWindows)
    windows.group, windows.rank, windows.timeout_s = None, 0, timeout_s
    windows._replies = queue.SimpleQueue()
    windows._replies_lock = threading.Lock()
    windows._replies_in_flight = 0
    windows._replies_left = 0
    windows._exit_lock = threading.Lock()
    windows._on_exit = None
    windows._ended = True  # the serving thread has returned
    return windows


def test_a_reply_whose_send_failed_does_not_keep_the_windows(monkeypatch):
    """h09: a send to a requester that is gone raises; it must not count as a reply still reading the window, or
    the windows are never freed."""
    def gone(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(remote_module.tdist, "isend", gone)
    windows = _server_side(timeout_s=0.2)
    with pytest.raises(RuntimeError, match="Connection closed"):
        windows._send_reply(torch.zeros(4), 1)
    windows._drain()
    released = []
    windows.after_serving(lambda: released.append(True))
    assert windows._replies_left == 0 and released == [True]


def test_a_reply_still_on_its_way_when_the_server_ends_keeps_the_windows(monkeypatch):
    """h15: a reply to a requester that stopped reading is a view of the window still being sent: the windows
    must stay mapped (never released), and are released once nothing is left on its way."""
    sending = _Sending()
    monkeypatch.setattr(remote_module.tdist, "isend", lambda *args, **kwargs: sending)
    windows = _server_side(timeout_s=0.2)
    reaper = threading.Thread(target=windows._see_replies_leave, daemon=True)
    reaper.start()
    windows._send_reply(torch.zeros(4), 1)
    windows._drain()  # waits min(STOP_WAIT_S, timeout_s) for the reply, which stays
    released = []
    windows.after_serving(lambda: released.append(True))
    assert windows._replies_left == 1 and released == []
    sending.left.set()
    reaper.join(5.0)
    assert not reaper.is_alive() and windows._replies_in_flight == 0

    done = _server_side(timeout_s=0.2)  # the control: a reply that left in time frees them
    done_reaper = threading.Thread(target=done._see_replies_leave, daemon=True)
    done_reaper.start()
    done._send_reply(torch.zeros(4), 1)
    done._drain()
    done.after_serving(lambda: released.append(True))
    assert done._replies_left == 0 and released == [True]


def test_rounds_of_different_kinds_with_the_same_step_and_length_both_raise_naming_both():
    """c01: a barrier on one rank (a checkpoint saved there) and a windows-rewritten round on the other (a load),
    both with no values at the same step: the kinds alone tell them apart, and both ranks must raise naming the
    other's round instead of pairing them."""
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        if rank == 0:
            runtime.barrier("save_checkpoint")
        else:
            runtime.windows_rewritten("re-publishing shards after load_checkpoint")

    for rank, (ok, err) in enumerate(group.run(rank_fn)):
        assert not ok and isinstance(err, ODCPeerError), (rank, err)
        assert f"rank {1 - rank}" in str(err) and "round 2" in str(err), err  # round 1: the open round
        theirs, mine = ("publishing shards rewritten outside a step", "save_checkpoint") if rank == 0 else \
            ("a barrier", "re-publishing shards after load_checkpoint")
        assert theirs in str(err) and mine in str(err), err
