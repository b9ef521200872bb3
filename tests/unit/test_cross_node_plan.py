"""``cross_node`` arithmetic (ds_odc/runtime/cross_node_plan.py): the design study's memory figures, the choice of
replicated layers (monotone in the budget, the same on every rank), the modes each request resolves to, and the
refusals; and that benchmarks/multinode_projection.py prints its tables."""
import doctest
import random

import pytest

from ds_odc.errors import ODCConfigError
from ds_odc.runtime import cross_node_plan
from ds_odc.runtime.cross_node_plan import (
    GIB,
    ModelStates,
    choose_replicated_layers,
    global_bytes,
    replicate_bytes,
    replicated_extra_bytes,
    resolve_cross_node,
    zero3_bytes,
)

P70, P8 = 70_553_706_496, 8_030_261_248  # Llama-3 70B and 8B
LAYERS_70B = [(f"model.layers.{i}", P70 // 80, 0) for i in range(80)]


def _gib(value):
    return round(value / GIB, 1)


def test_docstring_examples():
    failures, tried = doctest.testmod(cross_node_plan)
    assert tried > 0 and failures == 0


@pytest.mark.parametrize("nodes, zero3, zero3_fp32, today", [
    (1, 131.4, 147.8, 147.8), (2, 65.7, 73.9, 98.6), (4, 32.9, 37.0, 73.9), (8, 16.4, 18.5, 61.6)])
def test_the_design_studys_70b_table(nodes, zero3, zero3_fp32, today):
    world = 8 * nodes
    assert _gib(zero3_bytes(P70, P70, world)) == zero3
    assert _gib(zero3_bytes(P70, P70, world, gradient_bytes=4)) == zero3_fp32
    assert _gib(replicate_bytes(P70, P70, 8, nodes)) == today
    assert _gib(global_bytes(P70, P70, 8, nodes)) == zero3_fp32  # global with fp32 accumulators is 18P/W
    assert _gib(global_bytes(P70, P70, 8, nodes, accumulator_bytes=2)) == zero3  # bf16 accumulators: 16P/W


def test_the_8b_row_and_the_parts():
    assert [_gib(replicate_bytes(P8, P8, 8, n)) for n in (1, 2, 4, 8)] == [16.8, 11.2, 8.4, 7.0]
    parts = ModelStates(1600, 800, ranks_per_node=4, nodes=2).replicate()
    assert (parts.window, parts.accumulator, parts.optimizer) == (2 * 1600 / 4, 4 * 800 / 4, 12 * 800 / 8)
    parts = ModelStates(1600, 800, ranks_per_node=4, nodes=2, accumulator_bytes=8).global_sharded()
    assert (parts.window, parts.accumulator, parts.optimizer) == (2 * 1600 / 8, 8 * 800 / 8, 12 * 800 / 8)


def test_budget_states_run_from_global_to_replicate():
    states = ModelStates(1600, 1200, ranks_per_node=4, nodes=2)
    assert states.budget(0, 0) == states.global_sharded()
    assert states.budget(1200, 400).total == pytest.approx(states.replicate().total)
    # one replicated layer: (N-1)/W of (c+a) per trainable and c per frozen element
    assert states.budget(80, 40).total - states.global_sharded().total == pytest.approx(
        replicated_extra_bytes(80, 40, 2, 4)) == pytest.approx(1 / 8 * (6 * 80 + 2 * 40))
    with pytest.raises(ODCConfigError, match="exceed"):
        states.budget(1300)


def test_one_replicated_layer_costs_nothing_extra_on_one_node():
    assert replicated_extra_bytes(10 ** 9, 10 ** 9, 1, 8) == 0.0
    assert choose_replicated_layers(LAYERS_70B, 0, nodes=1, ranks_per_node=8) == tuple(n for n, _, _ in LAYERS_70B)


def test_the_choice_is_a_prefix_that_fits_and_grows_with_the_budget():
    rng = random.Random(0)
    layers = [(f"l{i}", rng.randrange(0, 10 ** 8), rng.randrange(0, 10 ** 7)) for i in range(40)]
    names = [name for name, _, _ in layers]
    previous: tuple = ()
    for budget_gib in [0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 100]:
        chosen = choose_replicated_layers(layers, budget_gib * GIB, nodes=4, ranks_per_node=8)
        assert list(chosen) == names[:len(chosen)]
        assert chosen[:len(previous)] == previous, "a larger budget dropped a layer"
        extra = sum(replicated_extra_bytes(t, f, 4, 8) for _, t, f in layers[:len(chosen)])
        assert extra <= budget_gib * GIB
        if len(chosen) < len(layers):  # the next layer would not have fit
            t, f = layers[len(chosen)][1:]
            assert extra + replicated_extra_bytes(t, f, 4, 8) > budget_gib * GIB
        previous = chosen
    assert previous == tuple(names)


def test_a_big_layer_stops_the_prefix():
    layers = [("a", 100, 0), ("big", 10 ** 6, 0), ("c", 100, 0)]
    assert choose_replicated_layers(layers, 1000, nodes=2, ranks_per_node=1) == ("a",)


def test_every_rank_picks_the_same_layers():
    """The choice depends on its arguments only (the same layers built separately, as lists or tuples, give the
    same answer), so ranks that see the same modules in the same order agree."""
    def layers(kind):
        return [kind((f"l{i}", 123_456_789 + i, 1000 * i)) for i in range(60)]

    choices = {resolve_cross_node("auto", 2, layers(kind), 4, 8) for kind in (tuple, list, tuple)}
    assert len(choices) == 1
    choice = choices.pop()
    assert choice.mode == "budget" and 0 < len(choice.replicated_layers) < 60


def test_what_each_request_resolves_to():
    names = tuple(n for n, _, _ in LAYERS_70B)
    extra_gib = (replicate_bytes(P70 // 80 * 80, P70 // 80 * 80, 8, 2) - global_bytes(P70 // 80 * 80, P70 // 80 * 80,
                                                                                         8, 2)) / GIB
    assert 24.6 < extra_gib < 24.7
    replicate = resolve_cross_node("replicate", None, LAYERS_70B, nodes=2, ranks_per_node=8)
    assert (replicate.mode, replicate.replicated_layers, _gib(replicate.bytes_per_rank)) == ("replicate", names, 98.6)
    shared = resolve_cross_node("global", None, LAYERS_70B, nodes=2, ranks_per_node=8)
    assert (shared.mode, shared.replicated_layers, _gib(shared.bytes_per_rank)) == ("global", (), 73.9)
    assert resolve_cross_node("auto", None, LAYERS_70B, 2, 8).mode == "replicate"
    assert resolve_cross_node("auto", 25, LAYERS_70B, 2, 8).mode == "replicate"  # the extra fits
    assert resolve_cross_node("budget", 25, LAYERS_70B, 2, 8).mode == "replicate"  # every layer fits
    for mode in ("auto", "budget"):
        partial = resolve_cross_node(mode, 20, LAYERS_70B, 2, 8)
        assert (partial.mode, partial.replicated_layers) == ("budget", names[:64])
        assert partial.reason.startswith(f"{mode}: replicate needs 98.6 GiB") and "64 of 80 layers" in partial.reason
        assert shared.bytes_per_rank < partial.bytes_per_rank <= shared.bytes_per_rank + 20 * GIB
        none = resolve_cross_node(mode, 0.2, LAYERS_70B, 2, 8)  # one layer needs 0.31 GiB
        assert (none.mode, none.replicated_layers, none.bytes_per_rank) == ("global", (), shared.bytes_per_rank)
    for mode, budget in (("replicate", None), ("global", None), ("budget", 0.0), ("auto", 0.0)):
        one = resolve_cross_node(mode, budget, LAYERS_70B, nodes=1, ranks_per_node=8)
        assert (one.mode, one.replicated_layers) == ("replicate", names) and "nothing crosses nodes" in one.reason
    assert "\n" not in partial.reason


def test_bytes_per_rank_fall_as_the_budget_falls():
    totals = [resolve_cross_node("auto", b, LAYERS_70B, 4, 8).bytes_per_rank for b in (0, 1, 5, 10, 20, 40, 80)]
    assert totals == sorted(totals) and totals[0] < totals[-1]


@pytest.mark.parametrize("call, match", [
    (lambda: resolve_cross_node("hybrid", None, LAYERS_70B, 2, 8), "cross_node must be one of"),
    (lambda: resolve_cross_node("budget", None, LAYERS_70B, 2, 8), "needs node_replica_budget_gb"),
    (lambda: resolve_cross_node("replicate", 10, LAYERS_70B, 2, 8), "applies to cross_node 'budget' and 'auto'"),
    (lambda: resolve_cross_node("auto", -1, LAYERS_70B, 2, 8), "node_replica_budget_gb must be"),
    (lambda: resolve_cross_node("auto", float("nan"), LAYERS_70B, 2, 8), "node_replica_budget_gb must be"),
    (lambda: resolve_cross_node("auto", True, LAYERS_70B, 2, 8), "node_replica_budget_gb must be"),
    (lambda: resolve_cross_node("auto", 1, [("a", 1, 0), ("a", 2, 0)], 2, 8), "appears twice"),
    (lambda: resolve_cross_node("auto", 1, [("a", -1, 0)], 2, 8), "trainable_numel must be an int >= 0"),
    (lambda: resolve_cross_node("auto", 1, [("a", 1)], 2, 8), r"must be \(name, trainable_numel, frozen_numel\)"),
    (lambda: resolve_cross_node("auto", 1, [("", 1, 0)], 2, 8), "non-empty str"),
    (lambda: resolve_cross_node("auto", 1, LAYERS_70B, 0, 8), "nodes must be an int >= 1"),
    (lambda: choose_replicated_layers(LAYERS_70B, -5, 2, 8), "budget_bytes must be"),
    (lambda: choose_replicated_layers(LAYERS_70B, 5, 2, 8, accumulator_bytes=0), "accumulator_bytes"),
    (lambda: ModelStates(10, 11, 8, 2), "exceeds params"),
    (lambda: ModelStates(10, 10, 8, 2).zero3(gradient_bytes=0), "gradient_bytes"),
])
def test_bad_input_is_refused_by_name(call, match):
    with pytest.raises(ODCConfigError, match=match):
        call()


def test_the_projection_script_prints_its_tables(capsys):
    """Smoke: the benchmark's closed forms run and print the 70B memory row of today's mode."""
    from benchmarks import multinode_projection

    text = multinode_projection.main(["--no-simulator"])
    assert "| replicate (today) | 6P/R + 12P/W | 147.8 | 98.6 | 73.9 | 61.6 |" in text
    assert "| T* global (tokens) | 4,000 | 6,000 | 7,000 |" in text
    assert text in capsys.readouterr().out


@pytest.mark.parametrize("mode,budget", [("global", None), ("budget", 25.0)])
def test_owners_on_other_nodes_are_refused_on_gpus_before_anything_is_made(mode, budget):
    """On GPUs pulls and pushes across nodes need the NVSHMEM transport, a GPU-kit item: on several nodes refused by
    name at the session's start, before any window or transport exists."""
    from types import SimpleNamespace

    import torch

    from ds_odc.runtime.session import SessionPlan, Shard, open_session

    plan = SessionPlan((Shard(0, 8, 2, "layers.0.weight"),), (), torch.bfloat16, "cuda:0", 1, 5.0, cross_node=mode,
                       replica_budget_gb=budget)
    with pytest.raises(ODCConfigError, match=f"cross_node='{mode}' runs on CPU hosts for now.*NVSHMEM"):
        open_session(plan, nodes=SimpleNamespace(node_count=2, local_world=2))


def test_on_gpus_auto_is_replicate_and_one_node_refuses_nothing():
    """``auto`` picks what runs: on GPUs replicate, saying why; on one node every value is the one-node layout."""
    names = tuple(n for n, _, _ in LAYERS_70B)
    for budget in (None, 20.0, 0.2):
        choice = resolve_cross_node("auto", budget, LAYERS_70B, 2, 8, sharding=False)
        assert (choice.mode, choice.replicated_layers) == ("replicate", names)
        assert choice.reason.startswith("auto on GPUs: replicate"), choice.reason
    for mode, budget in (("global", None), ("budget", 20.0)):
        one = resolve_cross_node(mode, budget, LAYERS_70B, nodes=1, ranks_per_node=8, sharding=False)
        assert one.mode == "replicate" and "nothing crosses nodes" in one.reason
        with pytest.raises(ODCConfigError, match=f"cross_node='{mode}' runs on CPU hosts for now"):
            resolve_cross_node(mode, budget, LAYERS_70B, nodes=2, ranks_per_node=8, sharding=False)
