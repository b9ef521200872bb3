"""Splitting long samples over aligned groups (ds_odc.balance.split): every sample once, groups aligned and
inside a node, one order of split micro-batches that no member can deadlock on, a step never worse than
LB-Mini's (nor than fixed SP's) under the same cost model, and the degenerate cases plain."""
import dataclasses
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ds_odc import ODCError
from ds_odc.balance import CostModel, plan_minibatch
from ds_odc.balance.split import fixed_groups, plan_split
from ds_odc.balance.split_cost import AllToAllCost, SplitCostModel, fit_all_to_all
from ds_odc.balance.split_plan import (
    SplitMicroBatch,
    SplitPlan,
    aligned_groups,
    group_sizes,
    max_group_for_heads,
)

GOLDEN = CostModel.quadratic_linear(1.982122, 2.611821, length_unit=32000)  # the paper's 1.5B fit, in seconds
CAP = 65536


def long_tailed(count, seed, cap=CAP, mean_log=9.4, sigma=0.9):
    rng = random.Random(seed)
    return [min(cap, max(512, int(rng.lognormvariate(mean_log, sigma)))) for _ in range(count)]


def lb_mini_step(lengths, world, cap, model, seed=0):
    return plan_minibatch(lengths, world, cap, "lb-mini", model, seed=seed).odc_step_cost()


def check_feasible(plan, max_group=8):
    """Everything the runtime relies on, checked from the outside (not through plan.validate)."""
    world, node = plan.world_size, plan.node_size
    lists = [plan.for_rank(rank) for rank in range(world)]
    placed = sorted(i for mine in lists for mb in mine if not mb.split for i in mb.samples)
    placed += [i for split in plan.splits for i in split.samples]
    assert sorted(placed) == list(range(len(plan.lengths)))
    for k, split in enumerate(plan.splits):
        p, first = split.group_size, split.ranks[0]
        assert p in (2, 4, 8) and p <= max_group
        assert first % p == 0 and first // node == split.ranks[-1] // node  # aligned, inside one node
        assert split.ranks[-1] < world
        assert -(-sum(plan.lengths[i] for i in split.samples) // p) <= plan.token_cap
        for rank in split.ranks:  # every member lists it, with the same sequence number, and knows its slice
            [entry] = [mb for mb in lists[rank] if mb.sequence == k]
            assert entry.samples == split.samples and entry.ranks == split.ranks and entry.part(rank) == rank - first
    for rank, mine in enumerate(lists):
        kinds = [mb.split for mb in mine]
        assert kinds == sorted(kinds, reverse=True)  # split micro-batches first
        sequences = [mb.sequence for mb in mine if mb.split]
        assert sequences == sorted(sequences)  # in the plan's one order
        for mb in mine:
            assert mb.samples and (mb.split or sum(plan.lengths[i] for i in mb.samples) <= plan.token_cap)
            assert rank in mb.ranks


def runs_without_deadlock(lists, durations):
    """Event simulation of the runtime: each rank walks its list; a split micro-batch starts only when every
    member has reached it. Returns each rank's finish, or raises if some rank can never go on."""
    position, clock = [0] * len(lists), [0.0] * len(lists)
    arrived: dict = {}
    progress = True
    while progress:
        progress = False
        for rank, mine in enumerate(lists):
            while position[rank] < len(mine):
                mb = mine[position[rank]]
                if not mb.split:
                    clock[rank] += durations(mb)
                    position[rank] += 1
                    progress = True
                    continue
                arrived.setdefault(mb.sequence, {})[rank] = clock[rank]
                if len(arrived[mb.sequence]) < len(mb.ranks):
                    break  # waits for a partner
                end = max(arrived[mb.sequence].values()) + durations(mb)
                for member in mb.ranks:
                    clock[member] = end
                    position[member] += 1
                progress = True
    stuck = [rank for rank, mine in enumerate(lists) if position[rank] < len(mine)]
    if stuck:
        raise AssertionError(f"ranks {stuck} deadlocked")
    return clock


# -- the plan's shape ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,per_rank", [(8, 1), (8, 2), (16, 1), (16, 2), (32, 1), (4, 3), (12, 1)])
@pytest.mark.parametrize("seed", range(3))
def test_plans_are_feasible_and_never_worse_than_lb_mini(world, per_rank, seed):
    lengths = long_tailed(world * per_rank, seed=world * 31 + per_rank * 7 + seed)
    plan = plan_split(lengths, world, CAP, GOLDEN, seed=seed)
    plan.validate()
    check_feasible(plan)
    assert plan.step_cost() <= lb_mini_step(lengths, world, CAP, GOLDEN, seed) * (1 + 1e-12)


@given(lengths=st.lists(st.integers(1, 4000), min_size=1, max_size=40), world=st.integers(1, 16),
       node=st.sampled_from([1, 2, 4, 6, 8]), max_group=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 3),
       latency=st.sampled_from([0.0, 5.0, 500.0]))
@settings(max_examples=150, deadline=None)
@example(lengths=[16, 56, 56], world=2, node=2, max_group=2, seed=0, latency=0.0)  # no long sample: not split
def test_any_minibatch_any_world(lengths, world, node, max_group, seed, latency):
    a2a = AllToAllCost(layers=1, all_to_alls_per_layer=2, bytes_per_token=1.0, bandwidth=8.0, latency=latency)
    model = CostModel(quadratic=1e-3, linear=1.0, per_micro_batch=3.0)
    plan = plan_split(lengths, world, 4000, model, a2a, node_size=node, max_group=max_group, min_chunk_tokens=64,
                      min_gain=0.0, seed=seed)
    check_feasible(plan, max_group)
    assert plan.step_cost() <= lb_mini_step(lengths, world, 4000, model, seed) * (1 + 1e-9)
    if not any(s >= 2 * 64 for s in lengths):
        return  # no sample reaches 2 x min_chunk_tokens: never split (below), even where fixed SP prices lower
    for p in group_sizes(world, node, max_group):  # and never worse than fixed SP of any size it may use
        fixed = fixed_groups(lengths, world, 4000, SplitCostModel(model, a2a), node, p, 64, seed)
        if fixed is not None:
            assert plan.step_cost() <= fixed.step_cost() * (1 + 1e-9)


def test_the_same_on_every_rank_and_every_call():
    lengths = long_tailed(32, seed=5)
    plans = [plan_split(list(lengths), 16, CAP, GOLDEN, seed=3) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]
    assert [plans[0].for_rank(r) for r in range(16)] == [plans[2].for_rank(r) for r in range(16)]
    assert plan_split(lengths, 16, CAP, GOLDEN, seed=4).step_cost() == pytest.approx(plans[0].step_cost(), rel=0.05)


@pytest.mark.parametrize("world,per_rank,seed", [(8, 1, 0), (16, 2, 1), (32, 1, 2), (32, 4, 3)])
def test_members_meet_without_deadlock_whatever_the_real_times(world, per_rank, seed):
    plan = plan_split(long_tailed(world * per_rank, seed=seed), world, CAP, GOLDEN, seed=seed)
    rng = random.Random(seed)
    jitter = {}
    lists = [plan.for_rank(rank) for rank in range(world)]
    finish = runs_without_deadlock(lists, lambda mb: jitter.setdefault((mb.samples, mb.ranks), rng.uniform(0.1, 10)))
    assert len(finish) == world
    # under the plan's own costs nobody waits for a partner: every member is free when the group starts
    ready = [0.0] * world
    for split, (start, end) in zip(plan.splits, plan.split_schedule()):
        assert {ready[r] for r in split.ranks} == {start}
        for r in split.ranks:
            ready[r] = end


def test_a_plan_whose_members_disagree_on_the_order_would_deadlock():
    """The event simulation above can see a deadlock: two groups sharing ranks 0-1, listed in opposite orders."""
    cost = SplitCostModel(CostModel.tokens(), AllToAllCost.free())
    plan = SplitPlan((10, 10), 10, cost, 8, (SplitMicroBatch((0,), 2, 0), SplitMicroBatch((1,), 2, 0)), ((), ()))
    lists = [plan.for_rank(0), plan.for_rank(1)]
    assert runs_without_deadlock(lists, lambda mb: 1.0) == [2.0, 2.0]
    with pytest.raises(AssertionError, match="deadlocked"):
        runs_without_deadlock([lists[0], lists[1][::-1]], lambda mb: 1.0)


# -- what it buys, under the cost model ------------------------------------------------------------------------
@pytest.mark.parametrize("world", [8, 16, 32])
def test_one_sample_per_rank_idles_far_less_than_lb_mini(world):
    for seed in range(3):
        lengths = long_tailed(world, seed=100 + seed, mean_log=9.5, sigma=0.7)
        whole = plan_minibatch(lengths, world, CAP, "lb-mini", GOLDEN, seed=seed)
        plan = plan_split(lengths, world, CAP, GOLDEN, seed=seed)
        assert whole.bubble_rate(collective=False) > 0.4
        assert plan.idle_fraction() < 0.15
        assert plan.splits


def test_only_the_long_sample_is_split_when_the_rest_balances():
    # one 60K sample among 15 of 4K on 8 ranks: the 60K one over 8 ranks, the rest whole
    lengths = [60000] + [4000] * 15
    plan = plan_split(lengths, 8, CAP, GOLDEN, all_to_all=AllToAllCost(bandwidth=20e9))
    assert [(s.samples, s.group_size) for s in plan.splits] == [((0,), 8)]
    assert sorted(len(batch) for r in plan.whole for batch in r) == [1] * 1 + [2] * 7


# -- degenerate cases --------------------------------------------------------------------------------------------
def test_one_rank_is_lb_mini():
    lengths = long_tailed(6, seed=1)
    plan = plan_split(lengths, 1, CAP, GOLDEN)
    assert plan.splits == () and plan.whole == plan_minibatch(lengths, 1, CAP, "lb-mini", GOLDEN).micro_batches


def test_all_short_samples_are_never_split():
    lengths = [random.Random(i).randint(512, 4095) for i in range(24)]  # all under 2 x min_chunk_tokens
    for world in (8, 16):
        plan = plan_split(lengths, world, CAP, GOLDEN, min_chunk_tokens=2048)
        assert plan.splits == ()
        assert plan.whole == plan_minibatch(lengths, world, CAP, "lb-mini", GOLDEN).micro_batches


def test_balanced_lengths_are_not_split():
    plan = plan_split([16000] * 16, 8, CAP, GOLDEN)
    assert plan.splits == () and plan.idle_fraction() == pytest.approx(0.0, abs=1e-12)


def test_no_samples_and_no_groups():
    assert plan_split([], 4, 100).whole == ((), (), (), ())
    assert plan_split([50000, 500], 8, CAP, GOLDEN, max_group=1).splits == ()  # max_group 1: never split


def test_bad_arguments_are_refused():
    for kwargs in ({"world_size": 0}, {"node_size": 0}, {"max_group": 0}, {"min_chunk_tokens": 0}, {"min_gain": 1.0}):
        with pytest.raises(ODCError):
            plan_split([10, 20], **{"world_size": 2, "token_cap": 100, **kwargs})
    with pytest.raises(ODCError, match="sample 0 has 201 tokens"):
        plan_split([201], 2, 100)  # a group of 2 holds 2 x 100 tokens of one sample at most


# -- samples longer than the cap: split over the smallest group that fits, or refused -------------------------
def smallest_fit(length, cap, sizes):
    """The fewest ranks holding ``length`` under ``cap`` each (a member holds ceil(length / p): the slices pad)."""
    return next((p for p in [1, *sizes] if -(-length // p) <= cap), None)


def test_a_sample_over_the_cap_is_split_even_where_lb_mini_is_better_and_min_chunk_says_no():
    # 1001 tokens with a cap of 1000 on 2 ranks: whole it would balance perfectly against the 1000 tokens of
    # short samples, and a member's 501 tokens are under min_chunk_tokens, yet the cap is a hard limit
    lengths = [1001, 500, 500]
    plan = plan_split(lengths, 2, 1000, node_size=2, max_group=2, min_chunk_tokens=2048, min_gain=0.5)
    check_feasible(plan, 2)
    assert [s.samples[:1] for s in plan.splits] == [(0,)] and plan.splits[0].group_size == 2


@pytest.mark.parametrize("length,group", [(2000, 2), (2001, 4), (4000, 4), (4001, 8), (8000, 8)])
def test_the_smallest_fitting_group_is_the_floor(length, group):
    # ceil(2001 / 2) = 1001 > 1000: the slices pad 2001 tokens to 2002, so 2001 needs 4 ranks
    plan = plan_split([length, 300, 300], 8, 1000, node_size=8, max_group=8, min_chunk_tokens=64)
    check_feasible(plan)
    [split] = [s for s in plan.splits if 0 in s.samples]
    assert split.group_size >= group


@pytest.mark.parametrize("kwargs,largest", [({"max_group": 2}, 2), ({"node_size": 2}, 2), ({"world_size": 2}, 2),
                                            ({"max_group": 1}, 1), ({"world_size": 1}, 1)])
def test_beyond_the_largest_group_the_sample_is_refused_by_name(kwargs, largest):
    arguments = {"world_size": 4, "token_cap": 1000, "node_size": 4, "max_group": 4, **kwargs}
    plan_split([100, largest * 1000], **arguments)  # the most the largest group holds: planned
    named = f"× {largest} ranks = {largest * 1000} tokens" if largest > 1 else "no sample can be split here"
    with pytest.raises(ODCError, match=rf"sample 1 has {largest * 1000 + 1} tokens, more than token_cap=1000.* "
                                       rf"{named}.*raise token_cap"):
        plan_split([100, largest * 1000 + 1], **arguments)


def test_fixed_sp_over_too_small_a_group_is_no_candidate():
    cost = SplitCostModel(CostModel.tokens(), AllToAllCost.free())
    assert fixed_groups([3000, 100], 4, 1000, cost, 4, 2) is None  # 1500 tokens a member: over the cap
    plan = fixed_groups([3000, 1000], 4, 1000, cost, 4, 4, min_chunk_tokens=2048)  # the 3000 one needs 4 ranks
    assert plan is not None and [s.samples for s in plan.splits] == [(0, 1)]


@given(data=st.data(), world=st.integers(1, 16), node=st.sampled_from([2, 4, 6, 8]),
       max_group=st.sampled_from([1, 2, 4, 8]), min_chunk=st.sampled_from([1, 64, 5000]), seed=st.integers(0, 3),
       latency=st.sampled_from([0.0, 500.0]), beyond=st.sampled_from([False, False, True]))
@settings(max_examples=150, deadline=None)
def test_any_sample_up_to_the_largest_group_trains_and_beyond_it_is_refused(data, world, node, max_group, min_chunk,
                                                                           seed, latency, beyond):
    cap = 1000
    sizes = group_sizes(world, node, max_group)
    most = max(sizes, default=1) * cap  # what the largest group holds of one sample
    longer = st.integers(cap + 1, most) if most > cap else st.integers(1, cap)
    lengths = data.draw(st.lists(st.one_of(st.integers(1, cap), longer), min_size=1, max_size=24))
    if beyond:  # one sample no group holds, anywhere in the minibatch
        index = data.draw(st.integers(0, len(lengths) - 1))
        lengths[index] = data.draw(st.integers(most + 1, most + cap))
    a2a = AllToAllCost(layers=1, all_to_alls_per_layer=2, bytes_per_token=1.0, bandwidth=8.0, latency=latency)
    model = CostModel(quadratic=1e-3, linear=1.0, per_micro_batch=3.0)
    kwargs = dict(node_size=node, max_group=max_group, min_chunk_tokens=min_chunk, seed=seed)
    if beyond:
        with pytest.raises(ODCError, match=f"sample {index} has {lengths[index]} tokens"):
            plan_split(lengths, world, cap, model, a2a, **kwargs)
        return
    plan = plan_split(lengths, world, cap, model, a2a, **kwargs)
    plan.validate()
    check_feasible(plan, max_group)
    group_of = {i: s.group_size for s in plan.splits for i in s.samples}
    floors = [smallest_fit(s, cap, sizes) for s in lengths]
    for i, floor in enumerate(floors):
        assert group_of.get(i, 1) >= floor  # over the cap: split, over at least the smallest group that fits
    if all(floor == 1 for floor in floors):
        assert plan.step_cost() <= lb_mini_step(lengths, world, cap, model, seed) * (1 + 1e-9)
        return
    for p in sizes:  # with a sample over the cap: never worse than fixed SP of a size that holds every sample
        fixed = fixed_groups(lengths, world, cap, SplitCostModel(model, a2a), node, p, min_chunk, seed)
        if fixed is not None:
            assert plan.step_cost() <= fixed.step_cost() * (1 + 1e-9)


def test_the_callers_plan_a_sample_over_the_cap_under_the_split_policy_only():
    from ds_odc.balance import BalancedBatchSampler
    from ds_odc.balance.slots import StepPlanner
    from ds_odc.balance.split_limits import SplitLimits

    lengths = [3500, 300, 200, 250, 900, 100, 120, 400]  # 3500 tokens: 3.5 x the cap, over 4 ranks
    common = dict(samples_per_rank=2, token_cap=1000, world_size=4, seed=1, shuffle=False)
    samplers = [BalancedBatchSampler(lengths, policy="lb-mini-split", rank=rank, max_group=4, node_size=4,
                                     all_to_all=AllToAllCost.free(), min_chunk_tokens=64, **common)
                for rank in range(4)]
    [entries] = samplers[0].entries()
    [long_one] = [entry for entry in entries if 0 in entry.samples]
    assert long_one.ranks == (0, 1, 2, 3) and all(long_one in sampler.entries()[0] for sampler in samplers)
    planner = StepPlanner(4, 0, 1000, "lb-mini-split", CostModel.tokens(), split_limits=SplitLimits(4, 4, 4),
                          min_chunk_tokens=64)
    assert any(0 in entry.samples and len(entry.ranks) == 4 for entry in planner.plan(lengths, seed=0).for_rank(0))
    with pytest.raises(ODCError, match="sample 0 has 3500 tokens, more than token_cap=1000 × 2 ranks"):
        StepPlanner(4, 0, 1000, "lb-mini-split", CostModel.tokens(), split_limits=SplitLimits(4, 4, 2)).plan(lengths, 0)
    with pytest.raises(ODCError, match="sample 0 has 3500 tokens, more than token_cap=1000: raise the cap"):
        BalancedBatchSampler(lengths, policy="lb-mini", rank=0, **common).plans()  # whole samples: the cap


def test_validate_refuses_a_whole_micro_batch_over_the_cap():
    cost = SplitCostModel(CostModel.tokens(), AllToAllCost.free())
    plan = SplitPlan((12, 2), 8, cost, 2, (SplitMicroBatch((0,), 2, 0),), (((1,),), ()))
    plan.validate()  # 12 tokens over 2 ranks: 6 each
    with pytest.raises(ODCError, match="rank 1 micro-batch 0 has 1 samples, 12 tokens"):
        dataclasses.replace(plan, splits=(), whole=(((1,),), ((0,),))).validate()


def test_validate_names_a_misaligned_or_cross_node_group_and_a_lost_sample():
    cost = SplitCostModel(CostModel.tokens(), AllToAllCost.free())
    good = SplitPlan((8, 2), 8, cost, 4, (SplitMicroBatch((0,), 2, 1),), ((), (), (), ((1,),)))
    good.validate()
    for bad in (dataclasses.replace(good, splits=(SplitMicroBatch((0,), 3, 0),)),  # not a power of two
                dataclasses.replace(good, node_size=3),  # ranks 2-3 straddle nodes 0 and 1
                dataclasses.replace(good, whole=((), (), (), ()))):  # sample 1 lost
        with pytest.raises(ODCError):
            bad.validate()


# -- groups, head counts, the all-to-all model -----------------------------------------------------------------
def test_groups_tile_nodes():
    assert aligned_groups(12, 6, 4) == [0, 2]  # ranks 4-7 would straddle the two nodes of 6
    assert aligned_groups(32, 8, 8) == [0, 1, 2, 3]
    assert group_sizes(12, 6, 8) == [2, 4]
    assert max_group_for_heads(32, 8) == 8 and max_group_for_heads(12, 2, limit=2) == 2
    with pytest.raises(ODCError):
        max_group_for_heads(12, 5)


def test_all_to_all_model_and_its_fit():
    a2a = AllToAllCost(layers=2, all_to_alls_per_layer=4, bytes_per_token=10.0, bandwidth=100.0, latency=1.0)
    assert a2a.seconds(1000, 1) == 0.0
    assert a2a.seconds(1000, 4) == pytest.approx(8 * (1.0 + 10.0 * 1000 * 3 / 16 / 100.0))
    split = SplitCostModel(CostModel(quadratic=1e-3, linear=2.0, per_micro_batch=5.0), a2a)
    for lengths in ([100], [300, 50, 7]):
        for p in (2, 4, 8):
            assert split.member_batch(lengths, p) == pytest.approx(split.fixed_group_model(p).micro_batch_cost(lengths))
    noisy = iter(random.Random(0).uniform(0.98, 1.02) for _ in range(100))
    fitted = fit_all_to_all(lambda n: a2a.per_all_to_all(n, 4) * next(noisy), [1000, 4000, 16000, 64000], 4,
                            bytes_per_token=10.0)
    assert fitted.bandwidth == pytest.approx(100.0, rel=0.1) and fitted.latency == pytest.approx(1.0, rel=0.5)
    with pytest.raises(ODCError, match="do not grow"):
        fit_all_to_all(lambda n: 1.0, [10, 20], 2)
    with pytest.raises(ODCError):
        AllToAllCost(bandwidth=0.0)

