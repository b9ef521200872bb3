"""Rounds outside a step, in one process (ranks are threads over the real control plane): the open
round, the gradient fence, the discard, batched pulls, and the exchanges of values and norms between
steps that frameworks and ZeRO-3's gradient reads use."""
import threading

import pytest
import torch

from ds_odc.errors import ODCPeerError, ODCStateError
from ds_odc.runtime import LossNormalization, MicroBatchLedger, ODCRuntime, WindowLayout
from ds_odc.runtime.phases import Event, Phase, StepStateMachine
from tests.support.loopback import LoopbackGroup, Update, runtime_for


# -- rounds outside a step: open, gradient fence, discard --------------------------------------------
def test_the_open_round_runs_once_before_anything_else_whatever_each_rank_does_first():
    """A rank whose first act is a pull and one that goes straight to the step (no micro-batch)
    both pass the open round first; each runs its publish hook right before it, once."""
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        opened = []
        layout = WindowLayout()
        layout.add_trainable(0, 32, 16)
        runtime = ODCRuntime(transport, layout, MicroBatchLedger(),
                             on_open=lambda: opened.append(transport.exchanges))
        transport.local_param_window().fill_(rank + 1)  # "written after the windows were made"
        if rank == 0:
            pulled = runtime.pull(0, torch.empty(32))
            runtime.push(0, torch.ones(32))
            runtime.record_micro_batch(LossNormalization.MEAN)
        else:
            pulled = None
        runtime.step(Update(transport))
        runtime.pull(0, torch.empty(32))
        return opened, pulled

    results = group.run(rank_fn)
    for ok, value in results:
        assert ok, value
    assert [value[0] for _, value in results] == [[0], [0]]  # once each, before the first round
    assert results[0][1][1].tolist() == [1.0] * 16 + [2.0] * 16  # rank 1's write, seen by rank 0's first pull


def test_a_gradient_fence_shows_every_rank_s_pushes_and_keeps_the_counts():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        if rank == 0:
            runtime.push(0, torch.full((16,), 4.0))
            runtime.record_micro_batch(LossNormalization.MEAN)
        runtime.sync_gradients("reading gradients")
        seen = transport.local_grad_accumulator()[:8].clone()
        phase = runtime.phase
        totals = runtime.step(Update(transport))
        return seen, phase, totals.per_rank_micro_batches

    for rank, (ok, value) in enumerate(group.run(rank_fn)):
        assert ok, value
        seen, phase, per_rank = value
        assert seen.tolist() == [2.0] * 8  # 4 / world size: ZeRO-3's reduce-scatter average
        assert phase is (Phase.ACCUMULATING if rank == 0 else Phase.IDLE)
        assert per_rank == (1, 0)  # the fence did not consume the counts


def test_discarding_gradients_zeroes_every_accumulator_and_count_on_every_rank():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.push(0, torch.full((16,), 3.0))
        runtime.record_micro_batch(LossNormalization.MEAN)
        runtime.discard_gradients("optimizer.zero_grad()")
        after_discard = transport.local_grad_accumulator().clone()
        phase = runtime.phase
        runtime.barrier("every rank looked")  # a peer may push the next micro-batch at once
        runtime.push(0, torch.full((16,), float(rank + 1)))
        runtime.record_micro_batch(LossNormalization.CALLER)
        update = Update(transport)
        totals = runtime.step(update)
        return after_discard, phase, totals.per_rank_micro_batches, update.norms.total()

    for ok, value in group.run(rank_fn):
        assert ok, value
        after_discard, phase, per_rank, norm = value
        assert not after_discard.any() and phase is Phase.IDLE and per_rank == (1, 1)
        assert norm == pytest.approx((16 * 1.5**2) ** 0.5)  # only the pushes after the discard: (1 + 2) / 2


def test_discarding_inside_a_step_is_refused():
    machine = StepStateMachine()
    for event in (Event.BEGIN_STEP, ):
        machine.advance(event)
    with pytest.raises(ODCStateError, match="gradients cannot be discarded inside an optimizer step"):
        machine.advance(Event.DISCARD)


def test_a_step_right_after_a_discard_with_no_micro_batch_anywhere_uses_the_old_gradients():
    """ZeRO-3's zero_grad only makes the next backward overwrite: with none, the step sees the old
    gradients. With a micro-batch on any rank, only the new ones count."""
    group = LoopbackGroup(2)

    def rank_fn(rank, transport, again):
        runtime = runtime_for(transport, numel=8)
        runtime.push(0, torch.full((16,), 2.0))
        runtime.record_micro_batch(LossNormalization.CALLER)
        runtime.discard_gradients("optimizer.zero_grad()")
        if again and rank == 1:
            runtime.push(0, torch.full((16,), 6.0))
            runtime.record_micro_batch(LossNormalization.CALLER)
        update = Update(transport)
        runtime.step(update)
        return update.norms.total()

    stale = group.run(lambda rank, transport: rank_fn(rank, transport, again=False))
    fresh = LoopbackGroup(2).run(lambda rank, transport: rank_fn(rank, transport, again=True))
    assert [v for _, v in stale] == [pytest.approx((16 * 2.0**2) ** 0.5)] * 2  # (2 + 2) / 2 per element
    assert [v for _, v in fresh] == [pytest.approx((16 * 3.0**2) ** 0.5)] * 2  # 6 / 2, rank 1's only


def test_pull_many_reads_every_owner_slice_in_one_transport_call():
    group = LoopbackGroup(1, param_numel=64)
    transport = group.transport(0)
    layout = WindowLayout()
    for key, numel in enumerate((5, 16, 1, 31)):  # odd sizes, packed one after another in the window
        layout.add_trainable(key, numel, numel)
    runtime = ODCRuntime(transport, layout, MicroBatchLedger())
    transport.local_param_window().copy_(torch.arange(64, dtype=torch.float32))
    calls = []
    original = transport.read_many
    transport.read_many = lambda reads: calls.append(len(reads)) or original(reads)
    outs = [torch.full((layout.slots[k].numel,), -1.0) for k in (3, 0, 1)]
    runtime.pull_many([3, 0, 1], outs).wait()
    assert calls == [3] and runtime.pulls == 3
    for key, out in zip((3, 0, 1), outs):
        expected = torch.empty(layout.slots[key].numel)
        runtime.pull(key, expected)
        assert torch.equal(out, expected), key
    with pytest.raises(ValueError, match="2 keys but 1 destinations"):
        runtime.pull_many([0, 1], outs[:1])


def test_a_failed_batched_pull_can_be_retried():
    group = LoopbackGroup(1)
    transport = group.transport(0)
    runtime = runtime_for(transport)
    original, calls = transport.read_many, []

    def flaky(reads):
        calls.append(1)
        if len(calls) == 1:
            raise OSError("transient read failure")
        return original(reads)

    transport.read_many = flaky
    with pytest.raises(OSError):
        runtime.pull_many([0], [torch.empty(16)])
    runtime.pull_many([0], [torch.empty(16)]).wait()
    assert runtime.phase is Phase.IDLE


# -- exchanges between steps: values (framework counts and metrics) and gradient norms ----------------
def test_exchanged_values_come_back_one_row_per_rank_and_a_dead_peer_is_named():
    group = LoopbackGroup(3)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        rows = runtime.exchange_values(torch.tensor([float(rank), 10.0 + rank]), "a test count")
        if rank == 2:
            group.alive[2] = False  # then it never arrives at the second exchange
            return rows
        return rows, runtime.exchange_values(torch.tensor([1.0]), "a second count")

    results = group.run(rank_fn)
    expected = torch.tensor([[0.0, 10.0], [1.0, 11.0], [2.0, 12.0]], dtype=torch.float64)
    assert results[2] == (True, results[2][1]) and torch.equal(results[2][1], expected)
    for rank in (0, 1):
        ok, error = results[rank]
        assert not ok and isinstance(error, ODCPeerError) and "rank 2" in str(error), error


def test_too_many_values_for_one_exchange_are_refused_by_name():
    group = LoopbackGroup(1)
    runtime = runtime_for(group.transport(0))
    with pytest.raises(ValueError, match="at most 8 values"):
        runtime.exchange_values(torch.zeros(9), "a test")


def test_gradient_norms_between_backward_and_step_sum_every_owner_and_leave_the_step_as_it_was():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        runtime.push(0, torch.full((32,), 2.0 * (rank + 1)))  # pushes arrive divided by the world size
        runtime.record_micro_batch(LossNormalization.CALLER)
        runtime.sync_gradients("a test read")
        norms = runtime.gradient_norms(transport.local_grad_accumulator().double().square().sum().reshape(1), "test")
        update = Update(transport)
        runtime.step(update)
        return norms.total(), update.norms.total()

    results = group.run(rank_fn)
    expected = (32 * 3.0 ** 2) ** 0.5  # every element: (2 + 4) / 2 = 3, over 2 owners x 16 elements
    for ok, (between, at_step) in results:
        assert ok and between == pytest.approx(expected) and at_step == pytest.approx(expected)


# -- gradient reads are snapshots ([Note: reads are snapshots]) ---------------------------------------------
class _Seen(Update):
    """Records the owner's gradients the update saw (after the fence's division)."""

    def apply(self, norms):
        self.seen = self.transport.local_grad_accumulator()[:8].clone()
        super().apply(norms)


def test_a_gradient_read_is_not_changed_by_a_faster_peer_s_next_push_and_its_writes_reach_the_step():
    """Rank 0 pushes its next micro-batch while rank 1 still holds what its read handed it (a live view of the
    accumulator moved under the reader, issue: DeepSpeed's test_param_persistence_threshold under load). Rank 1
    then writes into its copy: the step sees the write plus rank 0's later push, none lost."""
    group = LoopbackGroup(2)
    pushed, looked = threading.Event(), threading.Event()

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.push(0, torch.full((16,), 2.0))
        runtime.record_micro_batch(LossNormalization.CALLER)
        runtime.sync_gradients("optimizer.get_fp32_grad_partitions()")
        handed = runtime.own_gradients()
        at_read = handed.clone()
        if rank == 0:
            runtime.push(0, torch.full((16,), 6.0))  # the faster rank's next micro-batch, while rank 1 reads
            runtime.record_micro_batch(LossNormalization.CALLER)
            pushed.set()
            assert looked.wait(10)
        else:
            assert pushed.wait(10)
            after_peer = handed.clone()
            handed[:4] = 10.0  # safe_set_local_grad: a write into what the read handed
            looked.set()
        update = _Seen(transport)
        runtime.step(update)
        return at_read, None if rank == 0 else after_peer, update.seen

    results = group.run(rank_fn)
    assert all(ok for ok, _ in results), results
    (read0, _, step0), (read1, after1, step1) = (value for _, value in results)
    assert read0.tolist() == read1.tolist() == [2.0] * 8  # (2 + 2) / 2
    assert after1.tolist() == [2.0] * 8  # rank 0's next push did not move what rank 1 was handed
    # the step divides by the 3 micro-batches' mean (CALLER: 1); rank 0 owns [0, 8), rank 1 [8, 16)
    assert step0.tolist() == [5.0] * 8  # 2 + 6 / 2
    assert step1.tolist() == [10.0 + 3.0] * 4 + [5.0] * 4  # rank 1's write (10), then rank 0's later push (3)


def test_reads_in_a_row_with_no_push_between_reuse_one_copy_and_one_round():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        runtime = runtime_for(transport, numel=8)
        runtime.push(0, torch.full((16,), 2.0))
        rounds = transport.exchanges
        copies = [runtime.sync_gradients(f"read {i}") for i in range(3)]
        first_three = transport.exchanges - rounds
        runtime.push(0, torch.full((16,), 2.0))  # this rank's push ends its copy: the next read copies again
        copies.append(runtime.sync_gradients("read after a push"))
        runtime.record_micro_batch(LossNormalization.CALLER)
        runtime.step(Update(transport))
        return copies, first_three

    for ok, value in group.run(rank_fn):
        assert ok, value
        copies, first_three = value
        assert copies == [True, False, False, True]
        assert first_three == 2 + 1 + 1  # a fence and the copied round; then one fence round per reuse


def test_a_read_s_copy_ends_at_this_rank_s_next_push_and_the_views_move_back():
    group = LoopbackGroup(2)

    def rank_fn(rank, transport):
        moved = []
        layout = WindowLayout()
        layout.add_trainable(0, 16, 8)
        runtime = ODCRuntime(transport, layout, MicroBatchLedger(), on_gradients_moved=lambda: moved.append(1))
        runtime.push(0, torch.ones(16))
        runtime.sync_gradients("a read")
        during = runtime.own_gradients().data_ptr() != transport.local_grad_accumulator().data_ptr()
        runtime.push(0, torch.ones(16))
        after = runtime.own_gradients().data_ptr() == transport.local_grad_accumulator().data_ptr()
        runtime.record_micro_batch(LossNormalization.CALLER)
        runtime.step(Update(transport))
        return during, after, len(moved)

    for ok, value in group.run(rank_fn):
        assert ok and value == (True, True, 1), value
