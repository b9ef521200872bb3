"""Activation offload without processes: its options, the policy, the host pool, the hooks on a small model
(bit-identical gradients, views copied once, parameters never), the calibration and LB-Mini's transfer term."""
import pytest
import torch

from ds_odc.activations import (
    HostPool,
    MicroBatchOffload,
    SavedProfile,
    decide,
    measure_profile,
    plan_offload,
    pool_bytes,
    tokens_that_fit,
)
from ds_odc.balance import plan_minibatch
from ds_odc.balance.cost import CostModel, OffloadAwareCost, OffloadTransfer
from ds_odc.config import canonicalize, parse_options
from ds_odc.errors import ODCConfigError

# -- options ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block,field", [
    ({}, "activation_offload.budget_mb: Field required"),
    ({"budget_mb": -0.5}, "activation_offload.budget_mb: Input should be greater than or equal to 0"),
    ({"budget_mb": "512"}, "activation_offload.budget_mb"),
    ({"budget_mb": True}, "activation_offload.budget_mb"),
    ({"budget_mb": 1, "mode": "inputs"}, "activation_offload.mode: Input should be 'all' or 'checkpoint_inputs'"),
    ({"budget_mb": 1, "prefetch": 2}, "activation_offload.prefetch: not an option"),
])
def test_bad_activation_offload_options_name_the_field(block, field):
    with pytest.raises(ODCConfigError, match="zero_optimization.odc." + field):
        parse_options({"activation_offload": block})


def test_activation_offload_is_off_by_default_and_parses_both_modes():
    assert parse_options({}).activation_offload is None
    options = parse_options({"activation_offload": {"budget_mb": 0, "mode": "checkpoint_inputs"}})
    assert (options.activation_offload.budget_mb, options.activation_offload.mode) == (0.0, "checkpoint_inputs")


@pytest.mark.parametrize("extra,field", [({"activation_checkpointing": {"cpu_checkpointing": True}},
                                          "activation_checkpointing.cpu_checkpointing"),
                                         ({"compile": {"deepcompile": True}}, "compile.deepcompile")])
def test_what_offload_cannot_compose_with_is_refused_by_name_only_when_it_is_on(extra, field):
    with pytest.raises(ODCConfigError, match=field.replace(".", r"\.") + ".*activation_offload"):
        canonicalize({"zero_optimization": {"stage": "odc", "odc": {"activation_offload": {"budget_mb": 1}}}, **extra})
    assert canonicalize({"zero_optimization": {"stage": "odc"}, **extra}) is not None


# -- policy -------------------------------------------------------------------------------------------------
PROFILE = SavedProfile(offloadable=(20.0, 28.0, 28.0), kept=4.0)  # 80 bytes per token


def test_micro_batches_that_fit_are_left_alone_and_longer_ones_offload_their_first_tensors():
    assert decide(10, PROFILE, budget_bytes=800).tensors == 0
    assert decide(11, PROFILE, budget_bytes=800) == decide(11, PROFILE, 800)
    over = decide(11, PROFILE, budget_bytes=800)  # 880 saved: 80 over, the first tensor (220 bytes) covers it
    assert (over.saved_bytes, over.tensors, over.offload_bytes) == (880, 1, 220)
    assert decide(20, PROFILE, budget_bytes=800).tensors == 2  # 1600: 800 over, 400 + 560 needed
    everything = decide(20, PROFILE, budget_bytes=0)
    assert (everything.tensors, everything.offload_bytes) == (3, 1520)  # the 4 kept bytes per token stay


def test_plan_and_pool_size_follow_the_largest_single_offload():
    decisions = plan_offload([5, 11, 20, 8], PROFILE, 800)
    assert [d.offloads for d in decisions] == [False, True, True, False]
    assert pool_bytes(decisions) == max(d.offload_bytes for d in decisions) == 960
    assert tokens_that_fit(PROFILE, 800, offload=False) == 10 and tokens_that_fit(PROFILE, 800) == 200
    assert tokens_that_fit(SavedProfile((1.0,)), 800) is None  # nothing stays: the budget no longer bounds the cap


def test_the_pool_grows_to_the_largest_offload_spills_what_a_plan_missed_and_serves_a_second_live_lease_apart():
    pool = HostPool(pin=False)
    for size in (300, 1000, 200):
        lease = pool.reserve(size)
        first, second = lease.take(size - 100), lease.take(100)
        assert first.data_ptr() + size - 100 == second.data_ptr()  # back to back in the one buffer
        lease.release()
    assert (pool.stats.capacity, pool.stats.high_water, pool.stats.spilled_bytes) == (1000, 1000, 0)
    lease = pool.reserve(500)  # the plan said 500, the micro-batch saved 1200: 200 spill, none stays behind
    assert lease.take(1000).numel() == 1000 and lease.take(200).numel() == 200
    lease.release()
    assert (pool.stats.capacity, pool.stats.high_water, pool.stats.spilled_bytes) == (1200, 1200, 200)
    first = pool.reserve(100)
    second = pool.reserve(100)  # two forwards before a backward: correct, counted
    assert second.take(100) is not None and pool.stats.overflow_leases == 1
    first.release()
    second.release()


# -- hooks on a small model -----------------------------------------------------------------------------------
class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.relu(self.a(x))
        both = h.t() @ h  # h saved twice by matmul (as h and as h.t()): one storage, one copy
        return (torch.tanh(self.b(h)).sum() + both.sum())


def _is_parameter(model):
    addresses = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return lambda t: isinstance(t, torch.nn.Parameter) or t.untyped_storage().data_ptr() in addresses


def _grads(model, x, offload=None):
    model.zero_grad()
    if offload is None:
        loss = model(x)
    else:
        with offload.hooks():
            loss = model(x)
        offload.prefetch()
    loss.backward()
    if offload is not None:
        offload.finish()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_hooks_move_planned_storages_once_never_parameters_and_change_no_bit():
    model, x = _Model(), torch.randn(9, 6)
    profile = measure_profile(lambda: model(x), 9, "cpu", _is_parameter(model), lambda t: True)
    # input x, relu output h (once, though saved as h, h.t() and as b's input), tanh output
    assert profile.offloadable == (24.0, 24.0, 24.0) and profile.kept == 0.0
    reference = _grads(model, x)
    pool = HostPool(pin=False)
    for budget in (0, 9 * 72 - 1, 9 * 72):
        decision = decide(9, profile, budget)
        offload = MicroBatchOffload(decision, pool.reserve(decision.offload_bytes), torch.device("cpu"),
                                    _is_parameter(model), lambda t: True)
        loss, grads = _grads(model, x, offload)
        assert torch.equal(loss, reference[0]) and all(torch.equal(g, r) for g, r in zip(grads, reference[1]))
        stats = offload.stats
        assert (stats.moved_tensors, stats.moved_bytes) == (decision.tensors, decision.offload_bytes)
        assert stats.returned_bytes == stats.moved_bytes and stats.parameter_saves == 1  # b.weight (a: no input grad)
        assert stats.deduplicated == (3 if decision.tensors >= 2 else 0)  # relu, matmul (h, h.t()), b: one copy
    assert pool.stats.high_water == pool.stats.capacity == 3 * 9 * 24


def test_calibration_leaves_the_random_number_generator_as_it_was():
    model, x = _Model(), torch.randn(4, 6)
    before = torch.random.get_rng_state()
    measure_profile(lambda: torch.nn.functional.dropout(model.a(x), 0.5), 4, "cpu", _is_parameter(model),
                    lambda t: True)
    assert torch.equal(torch.random.get_rng_state(), before)


# -- LB-Mini's cost model --------------------------------------------------------------------------------------
def test_the_transfer_that_compute_cannot_hide_is_added_and_hides_better_on_long_micro_batches():
    transfer = OffloadTransfer(bytes_per_token=100.0, budget_bytes=1000.0, bytes_per_second=1000.0)
    assert transfer.exposed_seconds(10, compute_seconds=0.0) == 0.0  # fits: nothing moves
    base = CostModel(quadratic=1e-3, linear=1e-3)  # seconds
    model = OffloadAwareCost.around(base, transfer)
    short, long = [20], [2000]  # copies: 1 s and 199 s each way; compute: 0.42 s and 4002 s (a third forward)
    assert model.micro_batch_cost(short) == pytest.approx(base.micro_batch_cost(short) + 2 - 0.42)
    assert model.micro_batch_cost(long) == pytest.approx(base.micro_batch_cost(long))  # hidden entirely
    assert OffloadAwareCost.around(base, OffloadTransfer(100.0, 1e12, 1.0)).micro_batch_cost(long) == \
        base.micro_batch_cost(long)


def test_lb_mini_balances_with_the_transfer_priced():
    transfer = OffloadTransfer(bytes_per_token=1.0, budget_bytes=50.0, bytes_per_second=10.0)
    model = OffloadAwareCost.around(CostModel(linear=0.01), transfer)
    lengths = [100, 90, 40, 30, 30, 20, 10, 10]
    plan = plan_minibatch(lengths, world_size=2, token_cap=200, cost_model=model)
    plain = plan_minibatch(lengths, world_size=2, token_cap=200, cost_model=CostModel(linear=0.01))
    priced = [sum(model.micro_batch_cost([lengths[i] for i in batch]) for batch in rank) for rank in plan.micro_batches]
    assert plan.rank_costs() == pytest.approx(priced)  # the plan is priced with the transfer
    assert max(priced) <= max(sum(model.micro_batch_cost([lengths[i] for i in batch]) for batch in rank)
                              for rank in plain.micro_batches) + 1e-9


# -- measurements: the GPU benchmark skips without CUDA, and its GPU-kit verdict ---------------------------------
def test_the_gpu_benchmark_skips_cleanly_without_cuda(capsys, monkeypatch):
    from benchmarks import activation_offload

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert activation_offload.main(["--device", "cuda"]) == 0
    assert "no CUDA device here; skipped" in capsys.readouterr().out


def test_the_gpu_kit_verdict_holds_the_planned_offload_to_the_issue_s_goal(tmp_path):
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "scripts"))
    from gpu_validation import verdicts
    from gpu_validation.runner import Run, Status

    def run(peak, seconds):
        rows = lambda p, s: {"rows": [{"length": 8192, "peak": p, "seconds": s, "moved": 0, "naive": 0}]}  # noqa: E731
        (tmp_path / "activation_offload.json").write_text(json.dumps({"off": rows(100.0, 1.0),
                                                                      "planned": rows(peak, seconds)}))
        return verdicts.activation_offload_verdict(Run(0, 1.0, "", scratch=str(tmp_path)))

    assert run(45.0, 1.04).status == Status.PASS
    assert run(60.0, 1.0).status == Status.FAIL and run(40.0, 1.2).status == Status.FAIL


class _Attention(torch.nn.Module):
    """Saves an s×s tensor: bytes per token grow with the length (eager attention)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(4, 4)

    def forward(self, x):
        scores = torch.softmax(self.q(x) @ x.t(), dim=-1)
        return (scores @ x).sum()


def test_everything_planned_moves_even_past_the_estimate_and_the_profile_follows_the_longest_micro_batch():
    from ds_odc.config import ActivationOffloadConfig
    from ds_odc.integration.activation_offload import EngineOffload

    model = _Attention()
    offload = EngineOffload(ActivationOffloadConfig(budget_mb=0), model, "cpu")
    for rows in (4, 16, 8):
        x = torch.randn(rows, 4)
        with offload.forward(lambda x=x: model(x), (x,), {}, training=True):
            loss = model(x)
        offload.before_backward()
        loss.backward()
        offload.after_backward()
        stats = offload.history[-1]
        assert stats.moved_tensors == stats.planned_tensors and stats.kept_bytes == 0  # nothing stays behind
    per_token = [stats.moved_bytes / stats.tokens for stats in offload.history]
    assert per_token[1] > per_token[0]  # the 16-row micro-batch's s² scores outgrew the 4-row estimate: spilled
    assert offload.pool.stats.spilled_bytes > 0 and offload.profile_tokens == 16
    assert offload.history[2].planned_bytes >= offload.history[2].moved_bytes  # estimated from the longest now


def test_the_engine_side_decides_only_for_training_forwards_and_takes_a_planned_token_count():
    from ds_odc.config import ActivationOffloadConfig
    from ds_odc.integration.activation_offload import EngineOffload, tokens_of

    model = _Model()
    offload = EngineOffload(ActivationOffloadConfig(budget_mb=0), model, "cpu")
    x = torch.randn(5, 6)
    with offload.forward(lambda: model(x), (x,), {}, training=False):  # evaluation: nothing, not even calibration
        model(x)
    with torch.no_grad(), offload.forward(lambda: model(x), (x,), {}, training=True):
        model(x)
    assert offload.profile is None and not offload.history
    offload.plan_next(7)  # a planner's count wins over the inputs' (5 rows)
    with offload.forward(lambda: model(x), (x,), {}, training=True):
        loss = model(x)
    loss.backward()
    offload.after_backward()
    assert [stats.tokens for stats in offload.history] == [7] and offload.profile_tokens == 7
    assert tokens_of((), {"input_ids": torch.zeros(3, 4, dtype=torch.long)}) == 12
    assert tokens_of(({"a": 1},), {}) is None
