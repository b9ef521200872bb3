"""The step-time simulator: it reduces to the balance bound when communication is free, charges
communication exactly when nothing overlaps, hides it when it can, and shows the one behaviour the
product rests on: a straggler slows every rank under collectives, only itself under ODC."""
import dataclasses
import doctest
import importlib.util
import json
import os
import random

import pytest

import benchmarks.sim
import benchmarks.sim.hardware
import benchmarks.sim.presets
import benchmarks.sim.split
import benchmarks.sim.timeline
from benchmarks.sim import (
    Hardware,
    golden_preset,
    longalign_like_lengths,
    measured_preset,
    plan_from_record,
    project,
    simulate_step,
)
from benchmarks.sim.calibrate import calibrate, held_out_errors
from ds_odc import ODCError
from ds_odc.balance import CostModel, Plan, plan_minibatch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = CostModel(quadratic=1e-6, linear=1e-3, per_micro_batch=0.01)


def random_plan(world, per_rank, policy, seed):
    rng = random.Random(seed)
    lengths = [min(1000, max(1, int(rng.lognormvariate(5.0, 1.0)))) for _ in range(world * per_rank)]
    return plan_minibatch(lengths, world, 1000, policy, MODEL, seed=seed)


def plan_of(micro_batch_lengths):
    """A plan from ``[[lengths of rank r's micro-batch m] for m] for r]`` (one sample per entry)."""
    lengths, batches = [], []
    for rank in micro_batch_lengths:
        rank_batches = []
        for batch in rank:
            rank_batches.append(tuple(range(len(lengths), len(lengths) + len(batch))))
            lengths.extend(batch)
        batches.append(tuple(rank_batches))
    return Plan("test", tuple(lengths), 10**6, MODEL, tuple(batches))


def test_docstring_examples():
    for module in (benchmarks.sim, benchmarks.sim.hardware, benchmarks.sim.timeline, benchmarks.sim.presets,
                   benchmarks.sim.split):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__


@pytest.mark.parametrize("policy", ["lb-mini", "lb-micro", "local-sort"])
@pytest.mark.parametrize("world,per_rank,seed", [(2, 4, 0), (3, 5, 1), (8, 8, 2)])
def test_free_communication_gives_the_plans_own_step_costs_plus_fixed_costs(policy, world, per_rank, seed):
    plan = random_plan(world, per_rank, policy, seed)
    hardware = Hardware(layers=5, prefetch_depth=0, optimizer_seconds=0.25, fence_seconds=0.125)
    collective = simulate_step(plan, hardware, "collective")
    odc = simulate_step(plan, hardware, "odc")
    assert collective.step_seconds == pytest.approx(plan.collective_step_cost() + 0.25, rel=1e-12)
    assert odc.step_seconds == pytest.approx(plan.odc_step_cost() + 0.125 + 0.25, rel=1e-12)
    assert list(odc.rank_busy_seconds) == pytest.approx(plan.rank_costs(), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_prefetch_lets_collectives_drift_a_layer_but_stays_between_the_two_bounds(seed):
    plan = random_plan(4, 6, "lb-micro", seed)
    step = simulate_step(plan, Hardware(layers=4, prefetch_depth=1), "collective").step_seconds
    assert plan.odc_step_cost() - 1e-12 <= step <= plan.collective_step_cost() + 1e-12


def test_a_perfectly_balanced_plan_takes_the_same_time_under_both_schemes():
    plan = plan_of([[[300, 20], [100]]] * 4)
    hardware = Hardware(layers=3, gather_seconds=0.01, reduce_seconds=0.02, pull_seconds=0.01, push_seconds=0.02,
                        prefetch_depth=1, optimizer_seconds=0.1)
    collective = simulate_step(plan, hardware, "collective")
    odc = simulate_step(plan, hardware, "odc")
    assert collective.step_seconds == pytest.approx(odc.step_seconds, rel=1e-12)
    assert len(set(collective.rank_finish_seconds)) == 1 and len(set(odc.rank_finish_seconds)) == 1


@pytest.mark.parametrize("straggle", ["heavier micro-batch", "extra micro-batch"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_straggler_slows_every_rank_under_collectives_but_only_itself_under_odc(straggle, prefetch):
    base = [[[200], [100]] for _ in range(4)]
    slow = [list(rank) for rank in base]
    slow[2] = [[900], [100]] if straggle == "heavier micro-batch" else [[200], [100], [700]]
    hardware = Hardware(layers=4, gather_seconds=0.005, reduce_seconds=0.01, pull_seconds=0.005,
                        push_seconds=0.01, prefetch_depth=prefetch)
    extra = MODEL.micro_batch_cost([700])
    for scheme in ("collective", "odc"):
        before = simulate_step(plan_of(base), hardware, scheme).rank_finish_seconds
        after = simulate_step(plan_of(slow), hardware, scheme).rank_finish_seconds
        for rank in range(4):
            if scheme == "collective" or rank == 2:
                assert after[rank] > before[rank] + 0.9 * extra, (scheme, rank)
            else:
                assert after[rank] == before[rank], (scheme, rank)


def test_communication_adds_up_when_nothing_overlaps():
    layers, micro_batches, world = 3, 2, 4
    plan = plan_of([[[200], [100]]] * world)
    compute = sum(plan.micro_batch_costs()[0])
    g, r, p, q = 0.01, 0.03, 0.02, 0.05
    hardware = Hardware(layers=layers, gather_seconds=g, reduce_seconds=r, pull_seconds=p, push_seconds=q,
                        prefetch_depth=0, optimizer_seconds=0.5, fence_seconds=0.25,
                        collective_micro_batch_seconds=0.002, odc_micro_batch_seconds=0.004)
    per_pass = micro_batches * layers
    assert simulate_step(plan, hardware, "collective").step_seconds == pytest.approx(
        compute + per_pass * (2 * g + r) + micro_batches * 0.002 + 0.5, rel=1e-12)
    assert simulate_step(plan, hardware, "odc").step_seconds == pytest.approx(
        compute + per_pass * (2 * p + q) + micro_batches * 0.004 + 0.25 + 0.5, rel=1e-12)


@pytest.mark.parametrize("scheme", ["collective", "odc"])
def test_prefetch_hides_communication_shorter_than_a_layer_except_the_first_gather_and_last_reduce(scheme):
    plan = plan_of([[[200], [100]]] * 3)
    compute = sum(plan.micro_batch_costs()[0])
    shortest_layer = min(plan.micro_batch_costs()[0]) / 3 / 4  # forward third over 4 layers
    g, r = 0.2 * shortest_layer, 0.3 * shortest_layer
    hardware = Hardware(layers=4, gather_seconds=g, reduce_seconds=r, pull_seconds=g, push_seconds=r,
                        prefetch_depth=1)
    assert simulate_step(plan, hardware, scheme).step_seconds == pytest.approx(g + compute + r, rel=1e-12)


def test_collectives_pad_short_ranks_and_odc_does_not():
    plan = plan_of([[[100], [100], [100]], [[300]]])
    hardware = Hardware(layers=2, gather_seconds=0.01, pull_seconds=0.01)
    assert simulate_step(plan, hardware, "collective").micro_batches_run == (3, 3)
    assert simulate_step(plan, hardware, "odc").micro_batches_run == (3, 1)


def test_a_true_cost_model_other_than_the_planners_is_used_for_compute():
    plan = plan_of([[[100]], [[400]]])
    hardware = Hardware(layers=1, prefetch_depth=0)
    quadratic = CostModel(quadratic=1.0, linear=0.0)
    assert simulate_step(plan, hardware, "odc", cost_model=quadratic).step_seconds == pytest.approx(400.0 ** 2)


def test_simulation_and_projection_are_deterministic():
    plan = random_plan(8, 4, "lb-mini", 5)
    hardware = golden_preset(16)
    assert simulate_step(plan, hardware, "odc") == simulate_step(plan, hardware, "odc")
    assert longalign_like_lengths(50, seed=3) == longalign_like_lengths(50, seed=3)
    assert longalign_like_lengths(50, seed=3) != longalign_like_lengths(50, seed=4)
    assert project(8, 2, steps=2, seed=1) == project(8, 2, steps=2, seed=1)


def test_longalign_like_lengths_match_the_stated_moments():
    lengths = longalign_like_lengths(20000, seed=0)
    assert 16000 < sum(lengths) / len(lengths) < 17100
    assert max(lengths) == 65536 and min(lengths) >= 256
    assert 0.003 < sum(s == 65536 for s in lengths) / len(lengths) < 0.03


def test_golden_preset_spans_nodes_above_eight_ranks_and_one_sample_per_rank_is_a_tie():
    one_node, two_nodes = golden_preset(8), golden_preset(16)
    assert one_node.pull_seconds == pytest.approx(one_node.gather_seconds, rel=0.1)
    assert two_nodes.pull_seconds > 3 * two_nodes.gather_seconds
    projection = project(8, 1, steps=3)
    assert abs(projection.speedup("odc", "lb-mini")) < 0.01  # one micro-batch each: nothing to gain
    assert projection.speedup("odc", "lb-mini", bound=True) == pytest.approx(0.0, abs=1e-12)


def test_bad_inputs_are_named():
    plan = plan_of([[[10]]])
    with pytest.raises(ODCError, match="scheme"):
        simulate_step(plan, Hardware(layers=1), "ring")
    with pytest.raises(ODCError, match="gather_seconds"):
        Hardware(layers=1, gather_seconds=-1.0)
    with pytest.raises(ODCError, match="layers"):
        Hardware(layers=0)
    with pytest.raises(ODCError, match="unknown comm keys.*bogus"):
        measured_preset(MODEL, {"bogus": 1.0})
    with pytest.raises(ODCError, match="pull_per_micro_batch"):
        measured_preset(MODEL, {"pull_per_micro_batch": -0.1})
    with pytest.raises(ODCError, match="sample 5"):
        plan_from_record([10, 20], [[[0]], [[5]]], MODEL)


def recorded_runs(hardware, engine, policy, model=MODEL):
    """Two workloads (different draws) at 1, 2 and 4 samples per rank, timed by ``hardware``."""
    scheme = "collective" if engine == "zero3" else "odc"
    rng, runs = random.Random(0), []
    for workload, b in [(w, b) for w in ("first", "second") for b in (1, 2, 4)]:
        steps, seconds = [], []
        for step in range(3):
            lengths = [min(1000, max(1, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(2 * b)]
            plan = plan_minibatch(lengths, 2, 1000, policy, MODEL, seed=step)
            seconds.append(simulate_step(plan, hardware, scheme, model).step_seconds)
            steps.append({"lengths": lengths, "micro_batches": plan.micro_batches})
        runs.append({"workload": workload, "samples_per_rank": b, "engine": engine, "policy": policy,
                     "step_seconds": seconds, "steps": steps})
    return runs


def test_calibration_recovers_compute_and_each_engines_fixed_costs():
    truth = CostModel(quadratic=2e-6, linear=5e-4, per_micro_batch=0.0)
    engines = {"zero3": (0.03, 0.2), "odc": (0.01, 0.05)}  # (per micro-batch, per step) each engine really has
    runs = []
    for engine, (per_micro_batch, per_step) in engines.items():
        model = dataclasses.replace(truth, per_micro_batch=per_micro_batch)
        hardware = Hardware(layers=1, prefetch_depth=0, optimizer_seconds=per_step)
        for policy in (("lb-micro", "local-sort") if engine == "zero3" else ("lb-micro", "lb-mini")):
            runs += recorded_runs(hardware, engine, policy, model)
    start = CostModel(quadratic=1e-6, linear=0.0, per_micro_batch=0.1)  # a wrong fit to start from
    fitted = calibrate(runs, start)
    for engine, (per_micro_batch, per_step) in engines.items():
        model = fitted.cost_models[engine]
        assert model.quadratic == pytest.approx(2e-6, rel=1e-3) and model.linear == pytest.approx(5e-4, rel=1e-3)
        assert model.per_micro_batch == pytest.approx(per_micro_batch, rel=1e-3)
        assert fitted.hardware[engine].optimizer_seconds == pytest.approx(per_step, rel=1e-3)
    for held_out in held_out_errors(runs, start, group=lambda run: (run["workload"], run["samples_per_rank"])):
        assert held_out["predicted"] and max(held_out["relative_errors"]) < 1e-3


def _load_script():
    path = os.path.join(ROOT, "benchmarks", "sim_projection.py")
    spec = importlib.util.spec_from_file_location("sim_projection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def synthetic_results(path, noise=0.03):
    """What benchmarks/balance_matrix.py writes, made from the simulator itself plus ±noise."""
    comm = {"layers": 3, "gather_per_micro_batch": 0.006, "reduce_per_micro_batch": 0.009,
            "pull_per_micro_batch": 0.004, "push_per_micro_batch": 0.008, "optimizer": 0.02, "fence": 0.005,
            "odc_micro_batch_overhead": 0.001, "measured_on": "synthetic"}
    hardware = measured_preset(MODEL, {k: v for k, v in comm.items() if k != "measured_on"})
    rng = random.Random(0)
    data_of = {(b, step): [min(1000, max(1, int(rng.lognormvariate(5.5, 1.0)))) for _ in range(2 * b)]
               for b in (1, 4) for step in range(4)}  # every engine and policy sees the same minibatches
    runs = []
    for engine, policy in [("zero3", "lb-micro"), ("zero3", "local-sort"), ("odc", "lb-micro"), ("odc", "lb-mini")]:
        for b in (1, 4):
            steps, seconds = [], []
            for step in range(4):
                lengths = data_of[(b, step)]
                plan = plan_minibatch(lengths, 2, 1000, policy, MODEL, seed=step)
                scheme = "collective" if engine == "zero3" else "odc"
                truth = simulate_step(plan, hardware, scheme).step_seconds
                seconds.append(truth * (1 + rng.uniform(-noise, noise)))
                batches = [[list(batch) for batch in rank] for rank in plan.micro_batches]
                steps.append({"lengths": lengths, "micro_batches": batches})
            runs.append({"workload": "long-tailed", "samples_per_rank": b, "engine": engine, "policy": policy,
                         "step_seconds": seconds, "steps": steps})
    data = {"cost_model": dataclasses.asdict(MODEL), "comm": comm, "runs": runs}
    with open(path, "w") as handle:
        json.dump(data, handle)


def test_projection_script_replays_measured_runs_and_writes_the_table(tmp_path, capsys):
    results, out = tmp_path / "balance_matrix.json", tmp_path / "sim_projection.md"
    synthetic_results(results)
    summary = _load_script().main(["--results", str(results), "--out", str(out), "--ranks", "8,16",
                                   "--samples-per-rank", "1,4", "--steps", "2", "--no-sensitivity"])
    assert summary["overall_median_error"] < 0.03  # the noise we added, nothing more
    assert summary["overall_median_error_calibrated"] < 0.05
    text = out.read_text()
    assert "| long-tailed | 4 | odc | lb-mini | 4 |" in text
    assert "ignored (unknown to the simulator): measured_on" in text
    assert "| odc + lb-mini |" in text  # predicted vs measured speedup rows
    rows = [line for line in text.splitlines() if line.startswith(("| 8 |", "| 16 |"))]
    assert len(rows) == 4 and "golden" in text and "all methods ≈ equal" in text


def test_projection_script_without_measurements_still_projects(tmp_path, capsys):
    out = tmp_path / "sim_projection.md"
    assert _load_script().main(["--results", str(tmp_path / "absent.json"), "--out", str(out), "--ranks", "8",
                                "--samples-per-rank", "4", "--steps", "1"]) == {}
    text = out.read_text()
    assert "validation skipped" in text and "| 8 | 4 |" in text
    assert text.count("| token counts |") == 3  # the sensitivity table: three tails, two planners


def test_noise_floor_pairs_only_runs_the_simulator_cannot_tell_apart():
    script = _load_script()
    odc, zero3 = {"engine": "odc"}, {"engine": "zero3"}
    replays = [(odc, {"predicted": [1.0, 2.0], "measured": [1.0, 2.0]}),
               (odc, {"predicted": [1.0, 2.0], "measured": [1.1, 2.2]}),  # same steps, 10% slower
               (odc, {"predicted": [1.0, 2.5], "measured": [5.0, 5.0]}),  # a different plan
               (zero3, {"predicted": [1.0, 2.0], "measured": [9.0, 9.0]})]  # a different engine
    noise, pairs = script._noise_floor(replays)
    assert pairs == 1 and noise == pytest.approx(0.1 / 1.05)


def test_sequence_parallel_projection_divides_compute_adds_all_to_alls_and_one_group_has_nothing_to_balance():
    from benchmarks.sim.presets import GOLDEN_COST_MODEL
    from benchmarks.sim.sequence_parallel import all_to_all_seconds_per_token, project_sp, sp_cost_model

    assert all_to_all_seconds_per_token(1) == 0.0 and sp_cost_model(GOLDEN_COST_MODEL, 1) == GOLDEN_COST_MODEL
    halved = sp_cost_model(GOLDEN_COST_MODEL, 2)
    assert halved.quadratic == GOLDEN_COST_MODEL.quadratic / 2
    assert halved.linear == GOLDEN_COST_MODEL.linear / 2 + all_to_all_seconds_per_token(2) \
        > GOLDEN_COST_MODEL.linear / 2
    one_group = project_sp(8, 8, steps=2)  # SP over every rank: no data parallelism, no imbalance to remove
    assert all(abs(one_group.speedup("odc", policy)) < 0.02 for policy in ("lb-micro", "lb-mini"))
    four_groups = project_sp(8, 2, steps=2)
    assert four_groups.speedup("odc", "lb-mini") > 0


# -- splitting long samples (benchmarks/sim/split.py) ----------------------------------------------------------
def _split_plan(world, per_rank, seed, **kwargs):
    from ds_odc.balance.split import plan_split

    lengths = longalign_like_lengths(world * per_rank, seed=seed, minimum=512)
    return plan_split(lengths, world, benchmarks.sim.GOLDEN_TOKEN_CAP, benchmarks.sim.GOLDEN_COST_MODEL, **kwargs)


@pytest.mark.parametrize("world,per_rank,seed", [(8, 1, 0), (16, 2, 1), (32, 1, 2)])
def test_split_replay_with_free_communication_is_the_plans_own_step(world, per_rank, seed):
    plan = _split_plan(world, per_rank, seed)
    assert plan.splits
    hardware = Hardware(layers=4, prefetch_depth=0, optimizer_seconds=0.25, fence_seconds=0.125)
    result = benchmarks.sim.split.simulate_split_step(plan, hardware)
    assert result.step_seconds == pytest.approx(plan.step_cost() + 0.375, rel=1e-12)
    assert list(result.rank_busy_seconds) == pytest.approx(plan.rank_costs(), rel=1e-12)
    real = benchmarks.sim.split.simulate_split_step(plan, benchmarks.sim.presets.hierarchical_preset(world))
    assert real.step_seconds > plan.step_cost()  # pulls, pushes and the step's fixed costs only add


def test_split_replay_of_a_plan_without_splits_is_the_odc_replay():
    plan = _split_plan(8, 8, 0)  # eight samples per rank: LB-Mini is at its bound, nothing is split
    assert not plan.splits
    hardware = golden_preset(8)
    whole = Plan("lb-mini", plan.lengths, plan.token_cap, plan.cost.compute, plan.whole)
    assert benchmarks.sim.split.simulate_split_step(plan, hardware).step_seconds == pytest.approx(
        simulate_step(whole, hardware, "odc").step_seconds, rel=1e-12)


def test_split_projection_compares_every_method_on_the_same_minibatches():
    p = benchmarks.sim.split.project_split(8, 1, steps=2)
    assert set(p.step_seconds) == set(benchmarks.sim.split.METHODS)
    assert p.idle["odc split"] < p.idle["odc lb-mini"]
    assert p.step_seconds["odc split"] <= p.step_seconds["odc lb-mini"]
    assert 0 <= p.plan_idle <= p.idle["odc split"] + 1e-9  # the replay only adds communication and fixed costs
    small = benchmarks.sim.split.project_split(8, 1, steps=1, max_group=4, methods=("sp 4", "sp 8", "odc split"))
    assert "sp 8" not in small.step_seconds  # a model whose heads allow 4 cannot run fixed SP 8
    assert small.group_sizes[8] == 0
    with pytest.raises(ODCError, match="unknown method"):
        benchmarks.sim.split.project_split(8, 1, steps=1, methods=("sp 3x",))
