"""The protocol that reaches owners on other nodes (ds_odc/comm/remote.py), on one host without engines: what
its server does when a requester misbehaves. test_two_hosts_global.py runs it under engines across hosts."""
import pytest

from tests.support.harness import run_ranks
from tests.support.remote_workloads import WINDOW_NUMEL, requests_to_a_dead_owner, stalled_requester


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(stalled_requester, 3, timeout=120)


def test_a_requester_that_stops_reading_holds_up_only_its_own_replies(ranks):
    """Rank 2 asks rank 0 for 16 MiB and never reads the reply (stalled mid-pull): rank 0's server goes on
    answering rank 1's read and push at once, instead of waiting on rank 2's socket until a timeout."""
    owner, requester, _ = ranks
    assert requester["waited_s"] < 5.0, requester  # the bound a blocked server would have made it wait: 20 s
    assert requester["read"] == [float(100 + i) for i in range(8)]
    assert owner["accumulator"][4:8] == [1.0] * 4


def test_many_large_replies_in_flight_from_one_owner_all_arrive(ranks):
    """One pipelined batch of 100 reads of 1 MiB from one owner (a module's pull): every reply arrives with the
    owner's bytes, and the owner's server kept the group's connections whole while they streamed (a bounded wait
    on a reply still streaming made gloo fail every connection of the group)."""
    owner, requester, _ = ranks
    assert requester["many_ok"], requester
    assert owner["served_reads"] == 2 + 100


def test_a_read_beyond_the_owners_window_is_refused_before_it_is_sent(ranks):
    """Every rank's window has the same size under global sharding: a read past it is refused at once, naming
    the owner and the sizes, instead of waiting for a reply the owner could not send."""
    _, requester, _ = ranks
    assert f"lies beyond its window ({WINDOW_NUMEL} elements)" in requester["beyond"], requester
    assert "from rank 0" in requester["beyond"]


def test_requests_to_an_owner_already_dead_fail_naming_it():
    """A push and a pull to an owner whose process is gone, issued after gloo saw its connection close: gloo
    refuses the send as it is issued, before any wait. Each must still be an ODC error naming the owner, as when
    the owner dies while the request is awaited (on two hosts a rank killed after its forward was reported by a
    peer as gloo's bare "Connection closed by peer")."""
    report = run_ranks(requests_to_a_dead_owner, 2, timeout=90, report=True, wait_for=[0])
    status, errors = report.outcomes[0]
    assert status == "ok", errors
    for name in ("push", "pull"):
        assert errors[name] is not None, (name, errors)
        kind, message = errors[name]
        assert kind == "ODCPeerError", (name, errors)
        assert "rank 1" in message, (name, errors)
