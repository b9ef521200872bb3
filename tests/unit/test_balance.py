"""Balancers: every sample placed once, caps respected, near-optimal balance, deterministic plans."""
import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from ds_odc import ODCError
from ds_odc.balance import BalancedBatchSampler, CostModel, Plan, fit_cost_model, karmarkar_karp, plan_minibatch, refine
from ds_odc.balance.packing import pack_padded
from ds_odc.balance.partition import largest_part

POLICIES = ("lb-mini", "lb-micro", "local-sort")


def long_tailed(count, cap, seed):
    rng = random.Random(seed)
    return [min(cap, max(1, int(rng.lognormvariate(5.0, 1.0)))) for _ in range(count)]


def brute_force_largest_part(costs, parts, equal_size):
    best = float("inf")
    for assignment in itertools.product(range(parts), repeat=len(costs)):
        counts = [assignment.count(p) for p in range(parts)]
        if equal_size and max(counts) - min(counts) > 1:
            continue
        sums = [0] * parts
        for cost, part in zip(costs, assignment):
            sums[part] += cost
        best = min(best, max(sums))
    return best


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("world,per_rank,cap", [(2, 1, 1024), (2, 4, 1024), (3, 5, 700), (8, 8, 2048), (4, 3, 300)])
def test_plans_place_every_sample_once_under_the_cap(policy, world, per_rank, cap):
    lengths = long_tailed(world * per_rank, cap, seed=world * 100 + per_rank)
    plan = plan_minibatch(lengths, world, cap, policy, CostModel.quadratic_linear(2.0, 2.6, 1000), seed=3)
    placed = sorted(i for rank in plan.micro_batches for batch in rank for i in batch)
    assert placed == list(range(len(lengths)))
    for rank in plan.micro_batches:
        for batch in rank:
            assert batch and sum(lengths[i] for i in batch) <= cap
    costs = plan.micro_batch_costs()
    for rank_costs in costs:
        assert rank_costs == sorted(rank_costs, reverse=True)  # heaviest micro-batch first


def test_partition_is_near_optimal_against_brute_force():
    rng = random.Random(7)
    for equal_size in (False, True):
        optimal, cases = 0, 200
        for _ in range(cases):
            parts = rng.choice([2, 3])
            costs = [rng.choice([rng.randint(1, 100), rng.randint(1, 2000)]) for _ in range(rng.randint(2, 8))]
            partition = refine(costs, karmarkar_karp(costs, parts, equal_size), equal_size)
            if equal_size:
                sizes = [len(p) for p in partition]
                assert max(sizes) - min(sizes) <= 1
            got, best = largest_part(costs, partition), brute_force_largest_part(costs, parts, equal_size)
            assert got <= 1.05 * best, (costs, parts, equal_size, got, best)
            optimal += got == best
        assert optimal >= 0.95 * cases, (equal_size, optimal)


@pytest.mark.parametrize("per_micro_batch", [0.0, 0.5, 5.0])
def test_lb_micro_equal_counts_and_lb_mini_never_worse_for_odc(per_micro_batch):
    for seed in range(10):
        lengths = long_tailed(16, 2048, seed)
        model = CostModel(quadratic=2.0 / 1000 ** 2, linear=2.6 / 1000, per_micro_batch=per_micro_batch)
        micro = plan_minibatch(lengths, 4, 2048, "lb-micro", model, seed)
        mini = plan_minibatch(lengths, 4, 2048, "lb-mini", model, seed)
        assert [sum(len(b) for b in rank) for rank in micro.micro_batches] == [4, 4, 4, 4]
        assert len(set(micro.micro_batch_counts())) == 1
        assert mini.odc_step_cost() <= micro.odc_step_cost() + 1e-9
        assert micro.collective_step_cost() >= micro.odc_step_cost()
        if per_micro_batch == 0:  # (with a fixed cost, fewer micro-batches also means less total work)
            assert 0.0 <= mini.bubble_rate(collective=False) <= micro.bubble_rate(collective=True) + 1e-12


def test_lb_mini_gives_ranks_different_micro_batch_counts_when_that_balances():
    lengths = [1000, 1000, 700, 700, 600]  # the only even split: {1000, 1000} | {700, 700, 600}
    mini = plan_minibatch(lengths, 2, 1000, "lb-mini")
    assert sorted(mini.micro_batch_counts()) == [2, 3] and mini.rank_costs() == [2000.0, 2000.0]


def test_local_sort_deals_round_robin_one_sample_per_micro_batch():
    lengths = [5, 9, 1, 7, 3, 8]
    plan = plan_minibatch(lengths, 2, 10, "local-sort")
    assert plan.for_rank(0) == [[0], [4], [2]]  # samples 0, 2, 4 (lengths 5, 1, 3), longest first
    assert plan.for_rank(1) == [[1], [5], [3]]


def test_plans_are_deterministic_for_a_seed():
    lengths = [100] * 12 + [300] * 6  # many ties: the seed decides them
    for policy in POLICIES:
        assert plan_minibatch(lengths, 3, 400, policy, seed=5) == plan_minibatch(lengths, 3, 400, policy, seed=5)


@pytest.mark.parametrize("call,message", [
    (lambda: plan_minibatch([10, 2000], 2, 1024), "sample 1 has 2000 tokens, more than token_cap=1024"),
    (lambda: plan_minibatch([10, 0], 2, 1024), "sample 1 has length 0"),
    (lambda: plan_minibatch([10], 2, 1024, "greedy"), "unknown balancing policy 'greedy'"),
    (lambda: plan_minibatch([10], 0, 1024), "world_size must be >= 1"),
    (lambda: CostModel(quadratic=-1.0), "CostModel.quadratic must be >= 0"),
    (lambda: BalancedBatchSampler([1], samples_per_rank=1, token_cap=4, world_size=2, rank=2), "rank 2 is outside"),
    (lambda: BalancedBatchSampler([1], samples_per_rank=1, token_cap=4, world_size=6, rank=0, sequence_parallel_size=4),
     "sequence_parallel_size=4 must be >= 1 and divide world_size 6"),
])
def test_bad_inputs_name_the_problem(call, message):
    with pytest.raises(ODCError, match=message.replace("(", r"\(")):
        call()


def test_fit_recovers_a_known_cost_curve():
    truth = CostModel(quadratic=3e-7, linear=2e-4, per_micro_batch=5e-3)
    noise = random.Random(0)
    fitted = fit_cost_model(lambda s: truth.micro_batch_cost([s]) * (1 + noise.uniform(-0.01, 0.01)),
                            [64, 256, 512, 1024, 2048], repeats=3)
    assert fitted.quadratic == pytest.approx(truth.quadratic, rel=0.1)
    assert fitted.linear == pytest.approx(truth.linear, rel=0.1)
    assert fitted.per_micro_batch == pytest.approx(truth.per_micro_batch, rel=0.3)


def test_fit_on_a_real_attention_layer_grows_with_length():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 2, 128, batch_first=True)

    def run(length):
        layer(torch.randn(1, length, 64)).sum().backward()

    from ds_odc.balance import forward_backward_timer
    model = fit_cost_model(forward_backward_timer(run), [64, 256, 512, 1024], repeats=7)
    assert model.micro_batch_cost([1024]) > model.micro_batch_cost([64])


def test_sampler_yields_each_rank_its_micro_batches_and_covers_the_epoch_once():
    lengths = long_tailed(40, 512, seed=1)
    samplers = [BalancedBatchSampler(lengths, samples_per_rank=4, token_cap=512, world_size=2, rank=r, seed=9)
                for r in range(2)]
    seen = sorted(i for sampler in samplers for batch in sampler for i in batch)
    assert seen == list(range(40))  # 40 = 5 steps x 2 ranks x 4 samples: nothing dropped, nothing twice
    for sampler in samplers:
        assert len(sampler) == sum(sampler.micro_batches_per_step()) == len(list(sampler))
    first_epoch = list(samplers[0])
    samplers[0].set_epoch(1)
    assert list(samplers[0]) != first_epoch


def test_under_sequence_parallelism_the_ranks_of_a_group_get_the_same_micro_batches_planned_per_group():
    """4 ranks in SP groups of 2: the plan is the one for 2 replicas; ranks 0 and 1 yield group 0's micro-batches,
    ranks 2 and 3 group 1's, and the epoch is covered once per group."""
    lengths = long_tailed(40, 512, seed=2)
    kw = dict(samples_per_rank=4, token_cap=512, seed=3)
    with_sp = [list(BalancedBatchSampler(lengths, world_size=4, rank=r, sequence_parallel_size=2, **kw))
               for r in range(4)]
    per_group = [list(BalancedBatchSampler(lengths, world_size=2, rank=g, **kw)) for g in range(2)]
    assert with_sp == [per_group[0], per_group[0], per_group[1], per_group[1]]
    assert sorted(i for group in per_group for batch in group for i in batch) == list(range(40))


def test_sampler_groups_a_dataloader_into_steps():
    lengths = [300, 20, 40, 280, 500, 60, 70, 30, 200, 100, 90, 10]
    dataset = [torch.full((length,), index) for index, length in enumerate(lengths)]
    sampler = BalancedBatchSampler(lengths, samples_per_rank=3, token_cap=512, world_size=2, rank=1, shuffle=False)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=torch.cat)
    steps = list(sampler.group_steps(loader))
    assert [len(s) for s in steps] == sampler.micro_batches_per_step()
    for (plan, members), step_batches in zip(sampler.plans(), steps):
        expected = [[members[i] for i in batch] for batch in plan.micro_batches[1]]
        assert [sorted(set(b.tolist())) for b in step_batches] == [sorted(b) for b in expected]


# --- padded pricing (a collator that pads every sample of a micro-batch to its longest one) ---------

def rounded(length, multiple):
    return -(-length // multiple) * multiple


def hand_padded_cost(model, batch_lengths, multiple=1):
    longest = rounded(max(batch_lengths), multiple)
    return model.per_micro_batch + len(batch_lengths) * (model.quadratic * longest ** 2 + model.linear * longest)


@st.composite
def padded_cases(draw):
    multiple = draw(st.sampled_from([1, 1, 2, 8, 64]))
    cap = draw(st.integers(min_value=multiple, max_value=4096))
    most = cap // multiple * multiple  # the longest sample that still fits once rounded up
    lengths = draw(st.lists(st.integers(min_value=1, max_value=most), min_size=1, max_size=40))
    world = draw(st.integers(min_value=1, max_value=6))
    model = draw(st.sampled_from([CostModel.tokens(), CostModel(quadratic=2e-6, linear=2.6e-3, per_micro_batch=0.5)]))
    return lengths, world, cap, multiple, model, draw(st.integers(0, 3))


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(padded_cases(), st.sampled_from(POLICIES))
def test_padded_plans_respect_n_times_longest_and_place_every_sample_once(case, policy):
    lengths, world, cap, multiple, model, seed = case
    plan = plan_minibatch(lengths, world, cap, policy, model, seed, padding="padded", pad_to_multiple_of=multiple)
    assert (plan.padding, plan.pad_to_multiple_of) == ("padded", multiple)
    placed = sorted(i for rank in plan.micro_batches for batch in rank for i in batch)
    assert placed == list(range(len(lengths)))
    hand_costs = []
    for rank, rank_tokens in zip(plan.micro_batches, plan.micro_batch_tokens()):
        hand_costs.append([hand_padded_cost(model, [lengths[i] for i in batch], multiple) for batch in rank])
        for batch, tokens in zip(rank, rank_tokens):
            n_times_longest = len(batch) * rounded(max(lengths[i] for i in batch), multiple)
            assert batch and tokens == n_times_longest <= cap
    for costs, hand in zip(plan.micro_batch_costs(), hand_costs):
        assert costs == pytest.approx(hand)
    assert plan.odc_step_cost() == pytest.approx(max(sum(c) for c in hand_costs))
    for rank_costs in plan.micro_batch_costs():
        assert rank_costs == sorted(rank_costs, reverse=True)  # heaviest micro-batch first
    if policy == "lb-micro":
        shares = [sum(len(b) for b in rank) for rank in plan.micro_batches]
        assert max(shares) - min(shares) <= 1
        if len(lengths) % world == 0:
            assert len(set(plan.micro_batch_counts())) == 1
        else:  # a rank one sample short may stop at one sample per micro-batch, as packed LB-Micro does
            most = max(plan.micro_batch_counts())
            assert plan.micro_batch_counts() == [min(most, share) for share in shares]
    if policy == "local-sort":
        assert all(len(batch) == 1 for rank in plan.micro_batches for batch in rank)


def test_padded_costs_match_a_hand_computation():
    model = CostModel(quadratic=1.0, linear=2.0, per_micro_batch=10.0)
    plan = plan_minibatch([8, 7, 2, 2], 1, 16, "lb-mini", model, padding="padded")
    assert plan.for_rank(0) == [[0, 1], [2, 3]]  # 2·8 = 16 fits; 8 and 7 padded, then 2 and 2
    assert plan.micro_batch_tokens() == [[16, 4]]
    assert plan.micro_batch_costs() == [[10 + 2 * (64 + 16), 10 + 2 * (4 + 4)]]  # [170, 26]
    assert plan.odc_step_cost() == plan.collective_step_cost() == 196.0
    packed = plan_minibatch([8, 7, 2, 2], 1, 16, "lb-mini", model)
    assert packed.padding == "packed" and sum(packed.micro_batch_tokens()[0]) == 19  # packed pays no padding

    # equal shares {7, 2} | {6, 3}; 2·7 > 12 cuts rank 0 in two, so LB-Micro splits rank 1's [6, 3] (2·6 = 12
    # tokens, cost 12) into [6], [3] to match: 9 per rank, and micro-batch i is about as heavy on both ranks
    two = plan_minibatch([7, 6, 3, 2], 2, 12, "lb-micro", CostModel.tokens(), padding="padded")
    assert two.for_rank(0) == [[0], [3]] and two.for_rank(1) == [[1], [2]]
    assert two.micro_batch_costs() == [[7.0, 2.0], [6.0, 3.0]] and two.micro_batch_tokens() == [[7, 2], [6, 3]]
    assert two.odc_step_cost() == 9.0 and two.collective_step_cost() == 7.0 + 3.0
    assert two.bubble_rate(collective=True) == pytest.approx(1 - 18 / 20)


def test_pad_to_multiple_of_rounds_before_the_cap_and_the_cost():
    lengths = [5, 3, 3]
    exact = plan_minibatch(lengths, 1, 16, padding="padded")
    assert exact.micro_batch_tokens() == [[15]] and exact.micro_batch_costs() == [[15.0]]  # 3·5 <= 16
    by_four = plan_minibatch(lengths, 1, 16, padding="padded", pad_to_multiple_of=4)
    assert by_four.micro_batch_tokens() == [[16, 4]]  # 3·8 = 24 > 16: the 5 pads to 8, so 2·8 then 1·4
    assert by_four.micro_batch_costs() == [[16.0, 4.0]]
    model = CostModel(quadratic=1.0, linear=0.0, per_micro_batch=1.0)
    assert plan_minibatch([5], 1, 16, "local-sort", model, padding="padded",
                          pad_to_multiple_of=4).micro_batch_costs() == [[1.0 + 8 * 8]]


def test_padded_validate_counts_padding_not_just_tokens():
    lengths = (5, 3, 3)
    packed = Plan("lb-mini", lengths, 12, CostModel.tokens(), (((0, 1, 2),),))  # 11 tokens packed
    packed.validate()
    assert packed.micro_batch_tokens() == [[11]]
    with pytest.raises(ODCError, match="rank 0 micro-batch 0 has 3 samples, 15 padded tokens"):
        Plan("lb-mini", lengths, 12, CostModel.tokens(), (((0, 1, 2),),), "padded").validate()


def test_pack_padded_makes_the_fewest_micro_batches():
    rng = random.Random(11)
    for _ in range(150):
        cap = rng.randint(4, 40)
        lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 7))]
        got = pack_padded(range(len(lengths)), lengths, cap)
        assert all(len(b) * max(lengths[i] for i in b) <= cap for b in got)
        assert len(got) == brute_force_fewest_padded(lengths, cap), (lengths, cap, got)


def brute_force_fewest_padded(lengths, cap):
    return min(len(groups) for groups in set_partitions(list(lengths))
               if all(len(g) * max(g) <= cap for g in groups))


def set_partitions(items):
    """Every partition of ``items`` into non-empty groups (Bell(7) = 877 of them for 7 items)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in set_partitions(rest):
        yield [[first]] + partition
        for g in range(len(partition)):
            yield partition[:g] + [[first] + partition[g]] + partition[g + 1:]


@pytest.mark.parametrize("per_micro_batch", [0.0, 5.0])
def test_padded_lb_mini_never_worse_than_lb_micro_for_odc(per_micro_batch):
    for seed in range(8):
        lengths = long_tailed(16, 2048, seed)
        model = CostModel(quadratic=2.0 / 1000 ** 2, linear=2.6 / 1000, per_micro_batch=per_micro_batch)
        micro = plan_minibatch(lengths, 4, 2048, "lb-micro", model, seed, padding="padded", pad_to_multiple_of=8)
        mini = plan_minibatch(lengths, 4, 2048, "lb-mini", model, seed, padding="padded", pad_to_multiple_of=8)
        assert len(set(micro.micro_batch_counts())) == 1
        assert mini.odc_step_cost() <= micro.odc_step_cost() + 1e-9
        assert mini == plan_minibatch(lengths, 4, 2048, "lb-mini", model, seed, padding="padded", pad_to_multiple_of=8)


@pytest.mark.parametrize("call,message", [
    (lambda: plan_minibatch([10, 30], 1, 31, padding="padded", pad_to_multiple_of=8),
     "sample 1 has 30 tokens, 32 once padded to a multiple of 8, more than token_cap=31"),
    (lambda: plan_minibatch([10], 1, 32, padding="pad"), "unknown padding 'pad'"),
    (lambda: plan_minibatch([10], 1, 32, padding="padded", pad_to_multiple_of=0),
     "pad_to_multiple_of must be an int >= 1"),
    (lambda: plan_minibatch([10], 1, 32, pad_to_multiple_of=8), "pad_to_multiple_of=8 needs padding='padded'"),
    (lambda: Plan("lb-mini", (1,), 4, CostModel.tokens(), (((0,),),), "flat"), "unknown padding 'flat'"),
])
def test_bad_padding_inputs_name_the_problem(call, message):
    with pytest.raises(ODCError, match=message):
        call()


def test_planner_docstring_examples():
    import doctest

    import ds_odc.balance.planner
    failures, tried = doctest.testmod(ds_odc.balance.planner)
    assert tried > 0 and failures == 0


@pytest.mark.parametrize("padding", ["packed", "padded"])
@pytest.mark.parametrize("policy", POLICIES)
def test_fewer_samples_than_ranks_leaves_ranks_idle_and_terminates(policy, padding):
    plan = plan_minibatch([10, 7], 4, 100, policy, padding=padding)  # used to loop forever under lb-micro
    assert sorted(plan.micro_batch_counts()) == [0, 0, 1, 1] and sorted(plan.rank_costs()) == [0, 0, 7, 10]


def _loads(costs, base, partition):
    return [b + sum(costs[i] for i in part) for b, part in zip(base, partition)]


def test_refine_keeps_a_fixed_base_per_part():
    """``base``: load a part carries that no move takes away (the split planner's share of split samples)."""
    rng = random.Random(11)
    for _ in range(50):
        parts = rng.randint(2, 5)
        costs = [rng.randint(1, 50) for _ in range(rng.randint(1, 12))]
        base = [float(rng.randint(0, 80)) for _ in range(parts)]
        start = [[] for _ in range(parts)]
        for i in range(len(costs)):
            start[rng.randrange(parts)].append(i)
        refined = refine(costs, start, base=base)
        assert sorted(i for part in refined for i in part) == list(range(len(costs)))
        assert max(_loads(costs, base, refined)) <= max(_loads(costs, base, start))
    assert refine([5, 5], [[0, 1], []], base=[0.0, 100.0]) == [[0, 1], []]  # the loaded part takes nothing
    with pytest.raises(ODCError, match="base"):
        refine([1], [[0], []], base=[0.0])
