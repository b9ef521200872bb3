"""The runtime of split micro-batches in one process: the lockstep over the real control plane (ranks are
threads), the attention of packed samples, a rank's slice of a micro-batch, the heads check, the config, and
the mapping patch that installs the attention hook."""
import threading

import pytest
import torch

from ds_odc.balance.slices import split_batch
from ds_odc.balance.split_cost import AllToAllCost
from ds_odc.balance.split_limits import SplitLimits
from ds_odc.config import BalanceConfig, parse_options
from ds_odc.errors import ODCConfigError, ODCError, ODCPeerError, ODCTimeoutError
from ds_odc.integration.packed_attention import per_sample
from ds_odc.integration.patching import PatchSet
from ds_odc.integration.split_attention import AttentionShape, check_group
from ds_odc.runtime import LossNormalization
from ds_odc.runtime.split_lockstep import OWN, ODCSplitError, parse_split_key, split_key
from tests.support.loopback import LoopbackGroup, runtime_for

MEAN, TOKEN = LossNormalization.MEAN, LossNormalization.TOKEN


# -- the lockstep -------------------------------------------------------------------------------------------
def _run(group, body, timeout_s=5.0):
    """``body(rank, lockstep, runtime)`` on every rank of ``group``; [(ok, value or error)]."""

    def rank_fn(rank, transport):
        runtime = runtime_for(transport)
        return body(rank, runtime.split_lockstep(timeout_s), runtime)

    return group.run(rank_fn, timeout=20)


def test_keys_order_steps_then_sequences_then_forwards():
    keys = [split_key(1, 0, 1), split_key(1, 0, 2), split_key(1, 3, 1), split_key(1, OWN, 0), split_key(2, 0, 1)]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert [parse_split_key(k) for k in keys] == [(1, 0, 1), (1, 0, 2), (1, 3, 1), (1, OWN, 0), (2, 0, 1)]


def test_members_running_the_same_split_micro_batches_pass_and_others_are_not_waited_for():
    """Ranks 0-1 run split micro-batches 0 and 1 (two forwards in the first: a reference model's, then the
    policy's), rank 2 only its own micro-batches: nobody waits for a rank outside its split micro-batch. (Each
    forward's all-to-alls pair the members: a barrier here.)"""
    group = LoopbackGroup(3)
    all_to_all = threading.Barrier(2, timeout=10)

    def body(rank, lockstep, runtime):
        if rank < 2:
            with lockstep.inside(0, (0, 1)):
                lockstep.before_forward()
                all_to_all.wait()
                lockstep.before_forward()
                all_to_all.wait()
            with lockstep.inside(1, (0, 1)):
                lockstep.before_forward()
                all_to_all.wait()
        with lockstep.own_entry():
            lockstep.before_forward()  # an own micro-batch
        return parse_split_key(runtime.transport.control_plane.me.split_key())

    results = _run(group, body)
    assert results == [(True, (1, OWN, 0))] * 3


def test_a_member_that_skipped_the_split_micro_batch_is_named():
    group = LoopbackGroup(2)

    def body(rank, lockstep, runtime):
        if rank == 1:
            with lockstep.own_entry():
                lockstep.before_forward()  # went to its own micro-batches
            return None
        with lockstep.inside(0, (0, 1)):
            lockstep.before_forward()

    (ok, error), (ok1, _) = _run(group, body)
    assert not ok and ok1 and isinstance(error, ODCSplitError)
    assert str(error).startswith("split micro-batch 0 (ranks 0, 1): rank 0 started it in step 1 while rank 1 had "
                                 "gone on to its own micro-batches")
    assert runtime_failed(group, 0)


def test_forwards_outside_every_entry_publish_nothing_and_never_fail_a_member_however_late():
    """A reference model's log-probs before the step's micro-batches, an evaluation between and after them:
    forwards outside every entry. Rank 1, late by hundreds of milliseconds, runs several of them before each of
    its split micro-batches while rank 0 already waits in it: rank 0 is never told rank 1 went past, and the key a
    forward outside the entries leaves is the one the last entry published."""
    import time

    group = LoopbackGroup(2)
    all_to_all = threading.Barrier(2, timeout=10)

    def body(rank, lockstep, runtime):
        plane = runtime.transport.control_plane
        keys = []
        for sequence in (0, 1):
            if rank == 1:
                time.sleep(0.3)  # rank 0 is waiting in split micro-batch ``sequence`` by now
                for _ in range(5):
                    lockstep.before_forward()  # outside every entry
                    keys.append(parse_split_key(plane.me.split_key()))
                    time.sleep(0.02)
            with lockstep.inside(sequence, (0, 1)):
                lockstep.before_forward()
                all_to_all.wait()
        with lockstep.own_entry():
            lockstep.before_forward()
        lockstep.before_forward()  # after: an evaluation
        keys.append(parse_split_key(plane.me.split_key()))
        return keys

    (ok0, keys0), (ok1, keys1) = _run(group, body)
    assert ok0 and ok1, (keys0, keys1)
    assert keys1 == [(0, 0, 0)] * 5 + [(1, 0, 1)] * 5 + [(1, OWN, 0)]  # nothing published outside the entries
    assert keys0 == [(1, OWN, 0)]


def test_a_member_that_ran_forwards_outside_the_entries_and_skipped_the_split_one_is_still_named():
    """Forwards outside the entries publish nothing, so a member that skipped split micro-batch 0 is named when it
    starts its own entries (or reaches the step, as before)."""
    group = LoopbackGroup(2)

    def body(rank, lockstep, runtime):
        if rank == 1:
            lockstep.before_forward()  # a reference model's forward: nothing published
            with lockstep.own_entry():
                lockstep.before_forward()
            return None
        with lockstep.inside(0, (0, 1)):
            lockstep.before_forward()

    (ok, error), (ok1, _) = _run(group, body)
    assert not ok and ok1 and "rank 1 had gone on to its own micro-batches" in str(error)


def runtime_failed(group, rank):
    """The group's failure record was written by ``rank`` (every peer then raises it at its next wait)."""
    return group.blocks[rank].state() == -1 and group.blocks[rank].read_failure().origin == rank


def test_a_member_that_ran_fewer_forwards_in_it_and_went_on_is_named():
    """Rank 0 begins a second forward of split micro-batch 0 (a reference model's, then the policy's) while
    rank 1 ran one and went on to split micro-batch 1."""
    group = LoopbackGroup(2)
    second = threading.Event()

    def body(rank, lockstep, runtime):
        with lockstep.inside(0, (0, 1)):
            lockstep.before_forward()
            if rank == 0:
                second.wait(5)
                lockstep.before_forward()
        if rank == 1:
            with lockstep.inside(1, (0, 1)):
                runtime.transport.control_plane.me.set_split_key(split_key(1, 1, 1))
                second.set()

    (ok, error), _ = _run(group, body)
    assert not ok and "rank 0 started it in step 1 while rank 1 had gone on to split micro-batch 1" in str(error)


def test_a_member_that_went_to_a_round_is_named_with_the_round():
    group = LoopbackGroup(2)

    def body(rank, lockstep, runtime):
        if rank == 1:
            runtime.barrier("the test's barrier")
            return None
        with lockstep.inside(0, (0, 1)):
            lockstep.before_forward()

    (ok, error), (ok1, error1) = _run(group, body)
    assert not ok and isinstance(error, ODCSplitError) and "while rank 1 went to" in str(error)
    assert "after 0 micro-batches" in str(error)
    assert not ok1 and isinstance(error1, ODCPeerError) and "ODCSplitError" in str(error1)  # learnt at its round


def test_a_dead_member_and_a_silent_one_are_named_within_the_bound():
    group = LoopbackGroup(2)
    group.alive[1] = False

    def body(rank, lockstep, runtime):
        if rank == 0:
            with lockstep.inside(0, (0, 1)):
                lockstep.before_forward()

    (ok, error), _ = _run(group, body)
    assert not ok and isinstance(error, ODCPeerError) and "rank 1 exited" in str(error)
    assert "starting forward 1 of split micro-batch 0 (ranks 0, 1)" in str(error)

    silent = LoopbackGroup(2)
    released = threading.Event()

    def quiet(rank, lockstep, runtime):
        if rank == 1:
            released.wait(10)  # alive, never starts it, makes no progress
            return None
        try:
            with lockstep.inside(0, (0, 1)):
                lockstep.before_forward()
        finally:
            released.set()

    (ok, error), _ = _run(silent, quiet, timeout_s=0.3)
    assert not ok and isinstance(error, ODCTimeoutError) and "made no progress" in str(error)


def test_entering_what_this_rank_cannot_run_is_refused():
    group = LoopbackGroup(2)

    def body(rank, lockstep, runtime):
        errors = []
        for members in ((1, 2), (0,), (0, 5)):
            with pytest.raises(ODCSplitError) as caught:
                lockstep.enter(0, members)
            errors.append(str(caught.value))
        lockstep.enter(0, (0, 1))
        with pytest.raises(ODCSplitError, match="run one micro-batch at a time"):
            lockstep.enter(1, (0, 1))
        return errors

    (ok, errors), _ = _run(group, body)
    assert ok, errors
    assert "rank 0 is not a member of split micro-batch 0 (ranks 1, 2)" in errors[0]
    assert "rank 0 is not a member" in errors[1]
    assert "spans nodes (ranks 5 are not on this rank's node)" in errors[2]


# -- attention of packed samples -----------------------------------------------------------------------------
def test_packed_samples_attend_each_within_itself():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q, k, v = torch.randn(1, 4, 11, 8), torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8)
    positions = torch.cat([torch.arange(5), torch.arange(6)]).unsqueeze(0)
    packed, _ = per_sample(sdpa_attention_forward)(module, q, k, v, None, position_ids=positions)
    first, _ = sdpa_attention_forward(module, q[:, :, :5], k[:, :, :5], v[:, :, :5], None)
    second, _ = sdpa_attention_forward(module, q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], None)
    torch.testing.assert_close(packed, torch.cat([first, second], dim=1))
    one, _ = per_sample(sdpa_attention_forward)(module, q, k, v, None, position_ids=torch.arange(11)[None])
    torch.testing.assert_close(one, sdpa_attention_forward(module, q, k, v, None)[0])


# -- a rank's slice -------------------------------------------------------------------------------------------
class _Entry:
    def __init__(self, ranks):
        self.ranks = ranks

    def part(self, rank):
        return self.ranks.index(rank)


def test_slices_of_a_split_micro_batch_pad_shift_and_count_each_token_once():
    ids = torch.arange(10, 17).unsqueeze(0)  # 7 tokens: padded to 8 for 2 ranks
    labels = ids.clone()
    labels[0, 0] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(7).unsqueeze(0)}
    whole = split_batch(batch, _Entry((3,)), 3)
    assert whole["shift_labels"].tolist() == [[11, 12, 13, 14, 15, 16, -100]] and "labels" not in whole
    parts = [split_batch(batch, _Entry((2, 3)), rank) for rank in (2, 3)]
    assert [p["input_ids"].tolist() for p in parts] == [[[10, 11, 12, 13]], [[14, 15, 16, 0]]]
    assert [p["position_ids"].tolist() for p in parts] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    assert [p["shift_labels"].tolist() for p in parts] == [[[11, 12, 13, 14]], [[15, 16, -100, -100]]]
    assert sum(int((p["shift_labels"] != -100).sum()) for p in parts) == int((whole["shift_labels"] != -100).sum())


# -- heads, config, the mapping patch --------------------------------------------------------------------------
def test_a_group_the_heads_do_not_allow_is_refused_naming_them():
    assert check_group(AttentionShape(4, 2, 8, 2, "sdpa"), 2) == 2
    assert check_group(AttentionShape(12, 2, 8, 2, "sdpa"), None) == 4
    with pytest.raises(ODCConfigError, match="max_group=4: the model has 6 query heads and 2 key/value heads") as err:
        check_group(AttentionShape(6, 2, 8, 2, "sdpa"), 4)
    assert "the largest group these heads allow is 2" in str(err.value)
    with pytest.raises(ODCConfigError, match="none: the model cannot be split"):
        check_group(AttentionShape(3, 3, 8, 2, "sdpa"), 2)


def test_the_balance_block_takes_the_split_policy_and_its_fields_only_with_it():
    config = parse_options({"balance": {"policy": "lb-mini-split", "token_cap": 64, "max_group": 4,
                                        "min_chunk_tokens": 16}}).balance
    assert (config.policy, config.max_group, config.min_chunk_tokens) == ("lb-mini-split", 4, 16)
    assert BalanceConfig(token_cap=8, policy="lb-mini-split").max_group is None
    with pytest.raises(ODCConfigError, match=r"balance\.max_group: .*only with policy 'lb-mini-split'"):
        parse_options({"balance": {"token_cap": 64, "max_group": 2}})
    with pytest.raises(ODCConfigError, match=r"balance\.max_group: Input should be 2, 4 or 8"):
        parse_options({"balance": {"policy": "lb-mini-split", "token_cap": 64, "max_group": 3}})


def test_a_mapping_entry_is_replaced_once_and_put_back():
    registry = {"sdpa": "core"}
    patches = PatchSet("test")
    patches.replace_item(registry, "sdpa", lambda original: f"hook({original})")
    patches.replace_item(registry, "sdpa", lambda original: "twice")
    assert registry == {"sdpa": "hook(core)"} and patches.original(registry, "['sdpa']") == "core"
    patches.undo()
    assert registry == {"sdpa": "core"} and not patches.active
    patches.replace_item(registry, "sdpa", lambda original: "ours")
    registry["sdpa"] = "someone else's"
    patches.undo()
    assert registry == {"sdpa": "someone else's"}


# -- the sampler and the Trainer's slots under the split policy -------------------------------------------------
def _split_sampler(rank, **kwargs):
    from ds_odc.balance import AllToAllCost, BalancedBatchSampler

    lengths = [4000, 300, 200, 250, 3000, 100, 120, 400] * 2
    return BalancedBatchSampler(lengths, samples_per_rank=2, token_cap=4000, policy="lb-mini-split", world_size=4,
                                rank=rank, max_group=2, node_size=4, all_to_all=AllToAllCost.free(),
                                min_chunk_tokens=64, seed=1, **kwargs)


def test_the_sampler_gives_every_member_the_same_split_entries_and_every_sample_once():
    samplers = [_split_sampler(rank) for rank in range(4)]
    steps = len(samplers[0].plans())
    assert steps == 2
    split_seen = 0
    for step in range(steps):
        lists = [sampler.entries()[step] for sampler in samplers]
        _, members = samplers[0].plans()[step]
        placed = []
        for rank, mine in enumerate(lists):
            assert [e.split for e in mine] == sorted((e.split for e in mine), reverse=True)  # split ones first
            for entry in mine:
                if entry.split:
                    for other in entry.ranks:
                        assert entry in lists[other]  # every member lists it, with the same sequence
                    if entry.part(rank) == 0:
                        placed += entry.samples
                        split_seen += 1
                else:
                    placed += entry.samples
        assert sorted(placed) == list(range(len(members)))
        # what the loader fetches: each entry's samples, as dataset indices
        fetched = [batch for batch, _ in zip(iter(samplers[1]), range(100))]
        assert len(fetched) == len(samplers[1])
    assert split_seen >= 1  # the long samples do run split


def test_the_sampler_pairs_micro_batches_with_their_entries_and_refuses_what_cannot_run():
    sampler = _split_sampler(0)
    loader = list(sampler)  # a loader that yields the index lists themselves
    steps = list(sampler.planned_steps(loader))
    assert [[entry for entry, _ in step] for step in steps] == sampler.entries()
    assert [batch for step in steps for _, batch in step] == loader
    with pytest.raises(Exception, match="iterate planned_steps"):
        next(sampler.group_steps(loader))
    with pytest.raises(Exception, match="sequence_parallel_size=2 .fixed groups. cannot go with it"):
        _split_sampler(0, sequence_parallel_size=2)


def test_slots_carry_each_entry_and_cut_split_micro_batches_to_the_rank_slice():
    from ds_odc.balance import AllToAllCost, CostModel
    from ds_odc.balance.slots import SlotCollator, StepPlanner

    planner = StepPlanner(4, 1, 4000, "lb-mini-split", CostModel.tokens(), split_limits=SplitLimits(4, 4, 2),
                          min_chunk_tokens=64, all_to_all=AllToAllCost.free())
    lengths = [4000, 300, 200, 250, 3000, 100, 120, 400]
    items = planner.slots(0, list(range(100, 108)), lengths, 2)
    header = items[0][0]
    plan = planner.plan(lengths, seed=0)
    assert header.micro_batch_counts == tuple(len(plan.for_rank(r)) for r in range(4))
    # one rule for the step's count: a split micro-batch once, as global_samples counts its samples
    distinct = {(entry.samples, entry.ranks) for r in range(4) for entry in plan.for_rank(r)}
    assert plan.splits and header.global_micro_batches == len(distinct) < sum(header.micro_batch_counts)
    cut = []
    collator = SlotCollator(lambda samples: list(samples), lambda batch, entry: cut.append(entry) or ("slice", batch))
    slots = [collator([item[0]] + [(key, index) for key, index in item[1:]]) for item in items]
    entries = [e for slot in slots for e in (slot.entries or [])]
    assert entries == plan.for_rank(1)
    assert cut == [e for e in entries if e.split] and cut  # rank 1 is in a split micro-batch here
    first = slots[[bool(s.entries) for s in slots].index(True)]
    assert first.micro_batches[0][0] == "slice" and first.micro_batches[0][1] == [100 + i for i in cut[0].samples]


def test_a_split_forward_whose_backward_runs_outside_the_micro_batch_is_refused():
    """Checkpointed layers recompute their attention in backward: over the split micro-batch's group only if the
    backward runs inside ``engine.odc_micro_batch(entry)``."""
    import types

    from ds_odc.errors import ODCError
    from ds_odc.integration.split_attention import SplitRuntime

    lockstep = types.SimpleNamespace(entry=types.SimpleNamespace(sequence=3, title="split micro-batch 3"))
    split = SplitRuntime(AttentionShape(4, 2, 8, 2, "sdpa"), SplitLimits(4, 4, 2), 0, lockstep)
    split.note_forward(training=True)
    split.check_backward(TOKEN, "engine.backward()")  # inside: fine
    split.note_forward(training=True)
    lockstep.entry = None
    with pytest.raises(ODCError, match="the backward of split micro-batch 3 ran outside engine.odc_micro_batch"):
        split.check_backward(TOKEN, "engine.backward()")
    split.note_forward(training=True)  # a whole micro-batch's forward, and a frozen model's, are free
    split.check_backward(MEAN, "engine.backward()")


@pytest.mark.parametrize("rule", ["MEAN", "CALLER", "TOKEN", "CALLER declared a scaled token sum"])
@pytest.mark.parametrize("route", ["engine.backward()", "loss.backward()"])
def test_inside_a_split_micro_batch_only_a_loss_that_adds_up_over_the_slices_is_taken(rule, route):
    """Each member's gradient is its slice's, and the owners sum them: a mean over each slice would count the
    sample once per member. The per-token rule and a declared scaled token sum pass; the mean rule and a caller's
    loss that may be a mean are refused by name (before anything is pushed: the check runs where the route begins)."""
    import types

    from ds_odc.integration.split_attention import SplitRuntime

    lockstep = types.SimpleNamespace(entry=types.SimpleNamespace(sequence=0, title="split micro-batch 0 (ranks 0, 1)"))
    split = SplitRuntime(AttentionShape(4, 2, 8, 2, "sdpa"), SplitLimits(4, 4, 2), 0, lockstep)
    split.scaled_token_sum = rule.endswith("sum")
    normalization = LossNormalization[rule.split()[0]]
    if normalization is LossNormalization.TOKEN or split.scaled_token_sum:
        split.check_backward(normalization, route)
        return
    with pytest.raises(ODCConfigError) as caught:
        split.check_backward(normalization, route)
    message = str(caught.value)
    assert message.startswith(f"split micro-batch 0 (ranks 0, 1): {route} under ")
    assert "would count the sample once per member" in message and "scaled_token_sum=True" in message
    lockstep.entry = None  # the same loss outside a split micro-batch is the engine's usual business
    split.check_backward(normalization, route)


def test_split_limits_say_which_groups_exist_and_refuse_a_mismatch_by_name():
    limits = SplitLimits(world_size=8, node_size=4, max_group=2)
    assert limits.group_sizes == (2,) and limits.groups(2) == [0, 1, 2, 3] and limits.groups(4) == []
    assert limits.allows((6, 7)) and not limits.allows((0, 1, 2, 3)) and not limits.allows((1, 2))
    limits.check_matches({"max_group": None, "node_size": 4}, "a sampler")
    with pytest.raises(ODCConfigError) as caught:
        limits.check_matches({"max_group": 8, "node_size": 4}, "BalancedBatchSampler")
    assert str(caught.value).startswith("BalancedBatchSampler: max_group=8 (the engine's: 2). The engine created its "
                                        "split groups at initialize for world_size=8, node_size=4, max_group=2")
    for bad in ({"max_group": 3}, {"max_group": 16}, {"node_size": 16}, {"world_size": 0}):
        with pytest.raises(ODCError, match="SplitLimits: "):
            SplitLimits(**{"world_size": 8, "node_size": 4, "max_group": 2, **bad})


def test_the_sampler_takes_the_engines_limits_and_refuses_a_mismatch_at_its_first_iteration():
    """The engine owns the groups: a sampler given it plans with its limits; one that also asks for another
    max_group or node_size is refused when it first plans (on every rank alike: each plans every step); without
    an engine, both must be given."""
    import types

    from ds_odc.balance import BalancedBatchSampler

    engine = types.SimpleNamespace(odc_split_limits=SplitLimits(4, 4, 2))
    lengths = [4000, 300, 200, 250, 3000, 100, 120, 400] * 2
    common = dict(samples_per_rank=2, token_cap=4000, policy="lb-mini-split", world_size=4, rank=0,
                  all_to_all=AllToAllCost.free(), min_chunk_tokens=64, seed=1)
    sampler = BalancedBatchSampler(lengths, engine=engine, **common)
    explicit = BalancedBatchSampler(lengths, max_group=2, node_size=4, **common)
    assert sampler.entries() == explicit.entries()
    assert all(len(e.ranks) <= 2 for step in sampler.entries() for e in step)
    wrong = BalancedBatchSampler(lengths, engine=engine, max_group=8, **common)  # built: refused when it plans
    with pytest.raises(ODCConfigError, match=r"BalancedBatchSampler: max_group=8 \(the engine's: 2\)"):
        next(iter(wrong))
    with pytest.raises(ODCConfigError, match="the engine has no split policy"):
        next(iter(BalancedBatchSampler(lengths, engine=types.SimpleNamespace(odc_split_limits=None), **common)))
    with pytest.raises(Exception, match="pass engine="):
        BalancedBatchSampler(lengths, max_group=2, **common)


def test_the_dispatcher_runs_packed_whole_micro_batches_per_sample_and_the_rest_as_the_original():
    from ds_odc.integration.split_attention import SplitRuntime

    calls = []

    def core(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append((query.shape[2], attention_mask))
        return query.transpose(1, 2), None

    split = SplitRuntime(AttentionShape(4, 2, 8, 2, "sdpa"), SplitLimits(4, 4, 2), 0, lockstep=None)
    attend = split._dispatcher(core)
    q = torch.zeros(1, 4, 7, 8)
    attend(None, q, q, q, "mask", position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    assert calls == [(3, None), (4, None)]
    calls.clear()
    attend(None, q, q, q, "mask", position_ids=torch.arange(7)[None])
    attend(None, torch.zeros(2, 4, 7, 8), q, q, "mask", position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]] * 2))
    assert calls == [(7, "mask"), (7, "mask")]
