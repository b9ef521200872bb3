"""Slots: a step's planned micro-batches carried through a loop that counts batches (no processes).

The batch sampler replays accelerate's own ``BatchSamplerShard`` for every rank, so these tests use
the real class: what the Trainer's loader would give each rank is what the plan is built from."""
import pytest
import torch

from ds_odc.balance.cost import CostModel
from ds_odc.balance.slots import BalancedSlot, SlotCollator, SlotDataset, StepHeader, StepPlanner, slot_of_micro_batches

accelerate = pytest.importorskip("accelerate")


@pytest.mark.parametrize("count", range(0, 9))
@pytest.mark.parametrize("slots", range(1, 5))
def test_micro_batches_spread_in_order_with_the_last_slot_used(count, slots):
    placed = slot_of_micro_batches(count, slots)
    assert len(placed) == count and placed == sorted(placed) and all(0 <= s < slots for s in placed)
    if count:
        assert placed[-1] == slots - 1
    per_slot = [placed.count(s) for s in range(slots)]
    assert max(per_slot) - min(per_slot) <= 1 or count < slots


def test_every_rank_gets_its_share_and_together_they_cover_the_step_once():
    lengths = [40, 3, 7, 12, 30, 5, 9, 22, 4, 18, 6, 11]
    members = [100 + i for i in range(len(lengths))]
    seen, headers = [], set()
    for rank in range(3):
        planner = StepPlanner(3, rank, 48, "lb-mini", CostModel.tokens(), "padded")
        items = planner.slots(step=7, members=members, lengths=lengths, slots=2)
        assert len(items) == 2 and all(isinstance(slot[0], StepHeader) for slot in items)
        headers.add(items[0][0])
        for slot in items:
            seen += [index for _, index in slot[1:]]
    assert sorted(seen) == members
    header = headers.pop()
    assert not headers, "every rank must see the same header"
    assert header.samples == len(members) and header.global_micro_batches == sum(header.micro_batch_counts)
    assert 0 < header.planned_utilisation <= 1 and header.collective_cost >= header.odc_cost > 0


def test_the_collator_collates_each_micro_batch_with_the_users_collator():
    dataset = SlotDataset([{"input_ids": [i] * (i + 1)} for i in range(6)])
    header = StepHeader(0, (2, 1), (1.0, 1.0), 6)
    items = [dataset[header], dataset[(0, 1)], dataset[(0, 2)], dataset[(1, 5)]]
    slot = SlotCollator(lambda samples: [len(s["input_ids"]) for s in samples])(items)
    assert slot.header == header and slot.micro_batches == [[2, 3], [6]]
    empty = SlotCollator(lambda samples: samples)([dataset[header]])
    assert empty.micro_batches == []
    moved = BalancedSlot(header, [{"x": torch.ones(2)}]).to("cpu")
    assert torch.equal(moved.micro_batches[0]["x"], torch.ones(2))


def test_the_users_dataset_keeps_its_attributes_but_never_its_batch_fetch():
    class Rows(list):
        column_names = ["input_ids"]

        def __getitems__(self, indices):  # what HF datasets define; our items are not plain indices
            raise AssertionError("must not be called")

    wrapped = SlotDataset(Rows([{"input_ids": [1]}]))
    assert wrapped.column_names == ["input_ids"] and len(wrapped) == 1
    assert not hasattr(wrapped, "__getitems__")


@pytest.mark.parametrize("samples, even_batches", [(48, True), (50, True), (50, False)])
def test_each_step_holds_the_samples_accelerate_would_give_all_ranks(samples, even_batches):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from ds_odc.integration.hf_balance_loader import BalancedStepSampler

    world, per_device, accumulation = 2, 4, 3
    inner = BatchSampler(SequentialSampler(range(samples)), per_device, drop_last=False)
    shards = [BatchSamplerShard(inner, world, rank, even_batches=even_batches) for rank in range(world)]
    expected = [list(s) for s in shards]
    if len({len(s) for s in expected}) != 1:
        with pytest.raises(Exception, match="different numbers of batches"):
            list(BalancedStepSampler(shards[0], world_size=world, rank=0, accumulation_steps=accumulation,
                                     length_of=lambda i: 1 + i % 7, planner_for=None))
        return
    planners = [StepPlanner(world, rank, 64, "lb-mini", CostModel.tokens()) for rank in range(world)]
    streams = [list(BalancedStepSampler(shards[rank], world_size=world, rank=rank, accumulation_steps=accumulation,
                                        length_of=lambda i: 1 + i % 7,
                                        planner_for=lambda members, lengths, rank=rank: planners[rank]))
               for rank in range(world)]
    assert [len(s) for s in streams] == [len(e) for e in expected]  # one slot per batch the Trainer counts
    for start in range(0, len(expected[0]), accumulation):
        stop = start + accumulation
        wanted = sorted(i for shard in expected for batch in shard[start:stop] for i in batch)
        got = sorted(index for stream in streams for slot in stream[start:stop] for _, index in slot[1:])
        assert got == wanted, f"step starting at batch {start}"


def _pad(samples):
    longest = max(len(s["input_ids"]) for s in samples)
    return {"input_ids": torch.tensor([s["input_ids"] + [0] * (longest - len(s["input_ids"])) for s in samples])}


def test_auto_padding_is_read_from_what_the_collator_produces():
    pytest.importorskip("transformers")
    from transformers import DataCollatorWithFlattening

    from ds_odc.config import BalanceConfig
    from ds_odc.integration.hf_balance_loader import _decide_padding

    dataset = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7]}]
    length_of = lambda i: len(dataset[i]["input_ids"])  # noqa: E731
    auto = BalanceConfig(token_cap=8)
    assert _decide_padding(auto, dataset, _pad, [0, 1, 2], length_of) == "padded"
    assert _decide_padding(auto, dataset, DataCollatorWithFlattening(), [0, 1, 2], length_of) == "packed"
    assert _decide_padding(auto, dataset, _pad, [1, 2], length_of) == "packed"  # equal lengths: no difference
    assert _decide_padding(BalanceConfig(token_cap=8, padding="padded"), dataset, None, [0, 1], length_of) == "padded"
    with pytest.raises(Exception, match="set zero_optimization.odc.balance.padding"):
        _decide_padding(auto, dataset, lambda s: {"input_ids": torch.zeros(3, 3, 3)}, [0, 1], length_of)
