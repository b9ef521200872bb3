"""Windows away and back (``engine.offload_states`` / ``reload_states``), in one process: ranks are threads
over the real control plane and step protocol, the loopback transport's windows are list entries."""
import torch

from ds_odc.errors import ODCPeerError, ODCStateError
from ds_odc.runtime import LossNormalization
from ds_odc.runtime.residency import describe, disagreement, kinds_of, mask
from tests.support.loopback import LoopbackGroup, Update, runtime_for


def test_masks_name_the_windows():
    assert kinds_of(mask({"params", "grads"})) == {"params", "grads"} and kinds_of(mask(set())) == set()
    assert describe({"grads", "params"}) == "parameter window and gradient accumulator"
    rows = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    assert disagreement(rows, ("asked", "away")) == ("rank 0: asked parameter window, away no window; "
                                                     "rank 1: asked gradient accumulator, away no window")
    assert disagreement(rows[:1], ("asked", "away")) is None


def test_windows_away_keep_their_content_refuse_pulls_pushes_and_steps_until_they_are_back():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.own_trainable_shards().fill_(rank + 1.0)
        runtime.push(0, torch.full((16,), 2.0))  # gradients pushed before the offload must survive it
        runtime.record_micro_batch(LossNormalization.MEAN)
        moved = runtime.offload_windows({"params", "grads"})
        during = (sorted(runtime.windows_away), group.params[rank] is None,
                  runtime.own_trainable_shards().tolist(), runtime.own_gradients().tolist())
        again = runtime.offload_windows({"params"})  # already away: nothing moves, the call still meets
        back = runtime.reload_windows()
        pulled = runtime.pull(0, torch.empty(16)).tolist()
        runtime.step(Update(transport))
        return sorted(moved), during, sorted(again), sorted(back), pulled, runtime.windows_away

    for rank, (ok, value) in enumerate(group.run(rank_fn)):
        assert ok, value
        moved, during, again, back, pulled, away = value
        assert moved == back == ["grads", "params"] and again == [] and away == frozenset()
        assert during == (["grads", "params"], True, [rank + 1.0] * 8, [2.0] * 8)  # host copies, peers' sums in
        assert pulled == [1.0] * 8 + [2.0] * 8


def test_a_pull_while_away_fails_the_group_naming_the_call_that_brings_the_windows_back():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.offload_windows({"params"})
        if rank == 0:
            runtime.push(0, torch.ones(16))  # the accumulator is still there: pushes go on
            runtime.pull(0, torch.empty(16))
        else:
            runtime.reload_windows()

    (ok0, err0), (ok1, err1) = group.run(rank_fn)
    assert not ok0 and isinstance(err0, ODCStateError) and "engine.reload_states()" in str(err0)
    assert not ok1 and isinstance(err1, ODCPeerError) and "rank 0" in str(err1)


def test_the_step_refuses_while_any_window_is_away():
    group = LoopbackGroup(1)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.offload_windows({"grads"})
        runtime.step(Update(transport))

    ((ok, err),) = group.run(rank_fn)
    assert not ok and isinstance(err, ODCStateError) and "gradient accumulator" in str(err)


def test_ranks_moving_different_windows_are_refused_on_every_rank():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime_for(transport, numel=8).offload_windows({"params"} if rank == 0 else {"grads"})

    for ok, err in group.run(rank_fn):
        assert not ok and isinstance(err, (ODCStateError, ODCPeerError))
        assert "parameter window" in str(err) and "gradient accumulator" in str(err)


def test_a_rank_that_cannot_make_its_windows_again_is_named_and_a_retry_brings_them_back():
    group = LoopbackGroup(3)
    group.refuse_recreate[2] = True

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.own_trainable_shards().fill_(rank + 1.0)
        runtime.offload_windows({"params", "grads"})
        try:
            runtime.reload_windows()
            first = None
        except Exception as err:  # noqa: BLE001 - returned to the test
            first = err
        away = sorted(runtime.windows_away)
        runtime.reload_windows()
        return first, away, runtime.pull(0, torch.empty(24)).tolist(), runtime.phase.value

    for rank, (ok, value) in enumerate(group.run(rank_fn)):
        assert ok, value
        first, away, pulled, phase = value
        assert isinstance(first, MemoryError if rank == 2 else ODCStateError), first
        assert "rank(s) [2]" in str(first) or rank == 2
        assert away == ["grads", "params"] and phase == "idle"
        assert pulled == [1.0] * 8 + [2.0] * 8 + [3.0] * 8


def test_a_transport_that_cannot_move_its_windows_refuses_by_name_before_any_round():
    """A transport without window moves (``supports_residency`` false) used to enter the first round, copy the
    windows out, then fail the group at its first transport call."""
    import pytest

    from ds_odc.errors import ODCConfigError

    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.open()
        transport.supports_residency = False
        rounds = transport.exchanges
        with pytest.raises(ODCConfigError, match="the loopback transport cannot move its windows off the device"):
            runtime.offload_windows({"params"})
        with pytest.raises(ODCConfigError, match="nothing was moved, no rank met"):
            runtime.reload_windows()
        assert transport.exchanges == rounds and runtime.windows_away == frozenset()
        runtime.push(0, torch.ones(16))  # the group is intact: training goes on
        runtime.record_micro_batch(LossNormalization.CALLER)
        runtime.step(Update(transport))
        return True

    assert all(ok for ok, _ in group.run(rank_fn))
