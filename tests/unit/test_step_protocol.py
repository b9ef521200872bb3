"""The step protocol in one process (ranks are threads over the real control plane): its state
machine, its typed rounds, and its failure policy (all or nothing, nothing continues after a failure)."""
import itertools
import time

import pytest
import torch

from ds_odc.errors import ODCGroupFailedError, ODCPeerError, ODCStateError
from ds_odc.runtime import LossNormalization, MicroBatchLedger
from ds_odc.runtime.phases import TRANSITIONS, Event, Phase, StepStateMachine
from ds_odc.runtime.round_kinds import Activity, RoundKind
from ds_odc.runtime.step import StepProtocol
from tests.support.loopback import LoopbackGroup, Update, runtime_for


# -- the state machine ---------------------------------------------------------------------------------
def test_every_transition_not_in_the_table_is_refused_and_every_one_in_it_is_taken():
    for phase, event in itertools.product(Phase, Event):
        machine = StepStateMachine()
        machine.phase = phase
        if (phase, event) in TRANSITIONS:
            assert machine.advance(event) is TRANSITIONS[(phase, event)]
        else:
            with pytest.raises(ODCStateError, match=f"{event.value} is not allowed in phase {phase.value.upper()}"):
                machine.advance(event)
            assert machine.phase is phase


def test_the_table_forms_one_cycle_through_the_step():
    cycle = [Event.PUSH, Event.BEGIN_STEP, Event.FENCED, Event.NORMED, Event.UPDATED, Event.PUBLISHED]
    machine = StepStateMachine()
    phases = [machine.advance(event) for event in cycle]
    assert phases == [Phase.ACCUMULATING, Phase.FENCING, Phase.NORMING, Phase.UPDATING, Phase.PUBLISHING, Phase.IDLE]
    assert {TRANSITIONS[(p, Event.FAIL)] for p in Phase if p is not Phase.CLOSED} == {Phase.FAILED}
    assert (Phase.CLOSED, Event.FAIL) not in TRANSITIONS


# -- a healthy step ---------------------------------------------------------------------------------------
def test_a_step_fences_normalises_norms_updates_and_publishes_in_three_rounds():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        grad = torch.full((16,), float(rank + 1))
        runtime.push(0, grad)
        runtime.record_micro_batch(LossNormalization.CALLER)
        assert runtime.phase is Phase.ACCUMULATING
        update = Update(transport)
        totals = runtime.step(update)
        pulled = runtime.pull(0, torch.empty(16))
        return totals, update.norms.total(), transport.exchanges, runtime.phase, runtime.protocol.step_number, pulled

    results = group.run(rank_fn)
    for ok, value in results:
        assert ok, value
        totals, norm, rounds, phase, step_number, pulled = value
        assert totals.micro_batches[LossNormalization.CALLER] == 2 and totals.per_rank_micro_batches == (1, 1)
        # CALLER divides the sum (1 + 2 = 3 per element) by the world size: 1.5 in each of 16 elements
        assert norm == pytest.approx((16 * 1.5**2) ** 0.5)
        assert rounds == 1 + 3 and phase is Phase.IDLE and step_number == 2  # the open round, then the step's
        assert torch.equal(pulled, torch.ones(16))  # every owner added 1 to its shard in the update
    assert all(int(torch.count_nonzero(g)) == 0 for g in group.grads)  # accumulators cleared at publish


def test_the_norm_round_runs_whatever_the_update_does_with_it():
    """An overflowing step (non-finite norm) still has its three rounds (after the open round), on every rank."""
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        update = Update(transport, squares=float("inf") if rank == 0 else 1.0)
        runtime.step(update)
        return update.norms.finite, transport.exchanges

    assert [value for _, value in group.run(rank_fn)] == [(False, 1 + 3), (False, 1 + 3)]


# -- rounds that do not match ---------------------------------------------------------------------------
def test_ranks_in_different_rounds_both_raise_naming_both_sides():
    """One rank steps while the other meets outside a step (say, a checkpoint saved by one rank)."""
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        if rank == 0:
            runtime.step(Update(transport))
        else:
            runtime.barrier("save_checkpoint")

    results = group.run(rank_fn)
    for rank, (ok, err) in enumerate(results):
        assert not ok and isinstance(err, ODCPeerError), err
        other = 1 - rank
        assert f"rank {other}" in str(err) and "round 2" in str(err), err  # round 1: the open round
        assert "the step fence" in str(err) and "save_checkpoint" in str(err), err


def test_a_shorter_row_is_an_error_not_a_stale_tail():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        return transport.exchange(RoundKind.TEST, 1, torch.ones(3 if rank == 0 else 2))

    for ok, err in group.run(rank_fn):
        assert not ok and "values" in str(err) and ("3 values" in str(err) and "2 values" in str(err)), err


# -- failures poison the group ------------------------------------------------------------------------------
def test_an_update_that_raises_fails_every_rank_and_nothing_continues():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        failure = RuntimeError("optimizer exploded") if rank == 1 else None
        try:
            runtime.step(Update(transport, fail_with=failure))
        except Exception as first:  # noqa: BLE001 - checked below
            error = first
        else:
            error = None
        started = time.monotonic()
        if error is None:  # rank 0 finished the update before rank 1 failed: it learns at its next round
            try:
                runtime.step(Update(transport))
            except Exception as second:  # noqa: BLE001
                error = second
        waited = time.monotonic() - started
        refused = []
        for attempt in (lambda: runtime.pull(0, torch.empty(32)), lambda: runtime.push(0, torch.ones(32)),
                        lambda: runtime.step(Update(transport)), lambda: runtime.barrier("b")):
            with pytest.raises(ODCGroupFailedError) as info:
                attempt()
            refused.append(str(info.value))
        return error, waited, refused, runtime.phase

    results = group.run(rank_fn)
    (ok0, (error0, waited0, refused0, phase0)), (ok1, (error1, _, refused1, phase1)) = results
    assert ok0 and ok1
    assert isinstance(error1, RuntimeError) and "optimizer exploded" in str(error1)
    assert isinstance(error0, ODCPeerError) and "rank 1 failed at the optimizer update" in str(error0), error0
    assert "optimizer exploded" in str(error0) and waited0 < 1.0
    assert phase0 is Phase.FAILED and phase1 is Phase.FAILED
    for text in refused0 + refused1:
        assert "rank 1 failed at the optimizer update" in text and "engine.destroy()" in text


def test_a_timed_out_fence_retried_is_refused_and_the_late_rank_raises():
    """The desynchronisation of the issue: rank 1 times out at the fence while rank 0 is busy, catches
    it and steps again. The retry is refused; rank 0 raises when it reaches the fence."""
    group = LoopbackGroup(2, timeout_s=0.5)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        runtime.push(0, torch.ones(32))
        runtime.record_micro_batch(LossNormalization.CALLER)
        if rank == 0:
            time.sleep(1.5)  # host-side work longer than the timeout, no heartbeat
        outcomes = []
        for _ in range(2):
            try:
                runtime.step(Update(transport))
                outcomes.append("stepped")
            except ODCPeerError as err:
                outcomes.append(f"{type(err).__name__}: {err}")
        return outcomes

    (ok0, outcomes0), (ok1, outcomes1) = group.run(rank_fn)
    assert ok0 and ok1
    assert outcomes1[0].startswith("ODCTimeoutError: rank 0") and "no progress" in outcomes1[0]
    assert "running forward/backward of step 1" in outcomes1[0] and "timeout_s" in outcomes1[0]
    assert outcomes1[1].startswith("ODCGroupFailedError") and "rank 0" in outcomes1[1]
    assert outcomes0[0].startswith("ODCPeerError") and "no progress" in outcomes0[0], outcomes0
    assert outcomes0[1].startswith("ODCGroupFailedError")
    assert "stepped" not in outcomes0 + outcomes1


def test_a_dead_peer_is_reported_at_once_with_what_it_was_doing():
    group = LoopbackGroup(2, timeout_s=30.0)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        if rank == 1:
            runtime.pull(0, torch.empty(32))
            group.alive[1] = False  # as if killed in forward
            return None
        started = time.monotonic()
        with pytest.raises(ODCPeerError) as info:
            runtime.step(Update(transport))
        return str(info.value), time.monotonic() - started

    (ok, (message, waited)), _ = group.run(rank_fn)
    assert ok and waited < 1.0
    assert "rank 1 exited (killed, crashed, or its script ended) while running forward/backward of step 1" in message


def test_mixed_normalisation_rules_fail_every_rank_instead_of_wedging_the_engine():
    """Item 2 of the issue: the error used to leave the engine in STEP with stale accumulators."""
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        runtime.push(0, torch.ones(32))
        runtime.record_micro_batch(LossNormalization.TOKEN if rank == 0 else LossNormalization.MEAN, tokens=3)
        with pytest.raises(ODCPeerError, match="different normalisation rules"):
            runtime.step(Update(transport))
        with pytest.raises(ODCGroupFailedError, match="different normalisation rules"):
            runtime.pull(0, torch.empty(32))
        return runtime.phase

    assert [value for _, value in group.run(rank_fn)] == [Phase.FAILED, Phase.FAILED]


def test_a_peer_that_closed_while_others_wait_is_an_error():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        if rank == 1:
            runtime.close()
            return None
        with pytest.raises(ODCPeerError, match=r"rank 1 closed its engine \(engine.destroy\(\)\)"):
            runtime.step(Update(transport))
        return "raised"

    assert group.run(rank_fn)[0] == (True, "raised")


def test_activity_follows_the_protocol():
    group = LoopbackGroup(1)
    transport = group.transport(0)
    runtime = runtime_for(transport)
    block = group.blocks[0]

    def seen_by_peers() -> str:
        return transport.plane.activity_text(0)

    runtime.pull(0, torch.empty(16))
    assert seen_by_peers() == "running forward/backward of step 1 (0 micro-batches done)"
    runtime.push(0, torch.ones(16))
    runtime.record_micro_batch(LossNormalization.MEAN)
    assert seen_by_peers() == "running forward/backward of step 1 (1 micro-batches done)"
    runtime.step(Update(transport))
    assert seen_by_peers() == "idle before step 2 (no micro-batch of it yet)"
    with runtime.protocol.saving():
        assert seen_by_peers() == "saving a checkpoint (before step 2)"
    assert int(block.words[3]) == Activity.IDLE


def test_a_failed_pull_can_be_retried():
    group = LoopbackGroup(1)
    transport = group.transport(0)
    runtime = runtime_for(transport)
    original, calls = transport.read, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("transient read failure")
        return original(*args)

    transport.read = flaky
    with pytest.raises(OSError):
        runtime.pull(0, torch.empty(16))
    runtime.pull(0, torch.empty(16))
    assert runtime.phase is Phase.IDLE


def test_a_failed_push_poisons_the_group():
    group = LoopbackGroup(1)
    transport = group.transport(0)
    runtime = runtime_for(transport)

    def broken(*args):
        raise OSError("stripe lock lost")

    transport.accumulate = broken
    with pytest.raises(OSError):
        runtime.push(0, torch.ones(16))
    assert runtime.phase is Phase.FAILED
    record = transport.recorded_failure()
    assert record.origin == 0 and record.where == "a gradient push" and "stripe lock lost" in record.error


def test_step_protocol_refuses_after_close():
    group = LoopbackGroup(1)
    protocol = StepProtocol(group.transport(0), MicroBatchLedger())
    protocol.close()
    with pytest.raises(ODCStateError, match="destroyed"):
        protocol.before_pull()
