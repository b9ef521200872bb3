import pytest
import torch

from ds_odc.errors import ODCPeerError
from ds_odc.runtime import LossNormalization, MicroBatchLedger, WindowLayout, owner_slices
from ds_odc.runtime.ledger import FENCE_WIDTH


@pytest.mark.parametrize("numel,world", [(1, 1), (1, 4), (5, 2), (53, 4), (64, 4), (7, 3)])
def test_owner_slices_cover_every_element_once(numel, world):
    shard = -(-numel // world)
    covered = []
    for owner, start, count in owner_slices(numel, shard, world):
        assert 0 < count <= shard and start == owner * shard
        covered.extend(range(start, start + count))
    assert covered == list(range(numel))


def test_window_layout_puts_trainable_first_and_same_offsets_for_every_owner():
    layout = WindowLayout()
    a = layout.add_trainable(10, numel=5, shard_numel=3)
    b = layout.add_trainable(11, numel=4, shard_numel=2)
    c = layout.add_frozen(12, numel=3, shard_numel=2)
    assert (a.param_offset, b.param_offset, c.param_offset) == (0, 3, 5)
    assert (a.grad_offset, b.grad_offset, c.grad_offset) == (0, 3, None)
    assert (layout.param_numel, layout.grad_numel) == (7, 5)
    with pytest.raises(ValueError):
        layout.add_trainable(13, numel=1, shard_numel=1)


def _totals(*rows):
    """Fence rows: micro-batches per rule, tokens, and shared micro-batches (0 where a row leaves it out)."""
    return MicroBatchLedger.totals(torch.stack([torch.tensor(r + [0] * (FENCE_WIDTH - len(r)), dtype=torch.float64)
                                                for r in rows]))


def test_normalisation_divisors_follow_the_documented_rules():
    # accumulators hold (sum of gradients) / world, ZeRO-3's partitions; the divisor is applied on top.
    # rank 0 ran 1 MEAN micro-batch, rank 1 ran 3: the mean over 4 is sum / 4 = (sum / 2) / 2
    assert _totals([1, 0, 0, 0], [3, 0, 0, 0]).gradient_divisor(2) == 2.0
    # MEAN gradients arrive divided by gas too: 4 micro-batches at gas 2, equal counts -> ZeRO-3's, 1
    assert _totals([1, 0, 0, 0], [3, 0, 0, 0]).gradient_divisor(2, gas=2) == 1.0
    assert _totals([0, 1, 0, 0], [0, 3, 0, 0]).gradient_divisor(2) == 1.0
    assert _totals([0, 0, 2, 0], [0, 0, 1, 17]).gradient_divisor(2) == 8.5  # sum / 17 = (sum / 2) / 8.5
    assert _totals([0, 0, 2, 0], [0, 0, 1, 0]).gradient_divisor(2) == 0.5  # no token at all: grads are 0 anyway
    assert _totals([0, 0, 0, 0], [0, 0, 0, 0]).gradient_divisor(2) == 1.0
    totals = _totals([1, 0, 0, 0], [3, 0, 0, 0])
    assert totals.per_rank_micro_batches == (1, 3) and totals.total_micro_batches == 4
    assert totals.shared_micro_batches == 0


def test_shared_micro_batches_are_summed_apart_and_change_no_divisor():
    # ranks 0 and 1 ran one split micro-batch together (rank 1's record shared), rank 1 one of its own
    totals = _totals([0, 0, 1, 6, 0], [0, 0, 2, 9, 1])
    assert totals.total_micro_batches == 3 and totals.shared_micro_batches == 1
    assert totals.gradient_divisor(2) == 7.5  # tokens: each member counted its own slice's


def test_mixed_rules_in_one_step_are_an_error():
    with pytest.raises(ODCPeerError, match="MEAN, CALLER"):
        _totals([1, 0, 0, 0], [0, 1, 0, 0]).gradient_divisor(2)


def test_ledger_records_and_resets():
    ledger = MicroBatchLedger()
    ledger.record(LossNormalization.TOKEN, 5)
    ledger.record(LossNormalization.TOKEN, 0, shared=True)
    assert ledger.fence_vector().tolist() == [0, 0, 2, 5, 1]
    ledger.reset()
    assert ledger.micro_batches == 0
    with pytest.raises(ValueError):
        ledger.record(LossNormalization.TOKEN, -1)
