"""An unmodified Trainer with ``zero_optimization.odc.balance``: LB-Mini by config alone.

Runs shared by the tests (2 CPU ranks, a tiny Llama, long-tailed lengths, a padding collator; 8 steps
cross an epoch boundary, after a short last step of the epoch, so set_epoch reshuffling is compared too):
ODC + LB-Mini, ODC + LB-Micro, plain ZeRO-3 (the Trainer as users run it today), and one plain process
without DeepSpeed whose accumulation covers both ranks' batches (the same samples per step).
"""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.support.harness import run_ranks  # noqa: E402
from tests.support.hf_balance_workloads import balanced_trainer_run, stalled_peer_during_the_step_exchanges  # noqa: E402

STEPS = 8  # an epoch is 7 steps (104 samples, 16 per step, the last step 8): this crosses it
BUDGET_MB = 0.05  # activation offload: about half the 48-token cap's saved activations
LB_MINI = {"policy": "lb-mini", "token_cap": 48, "cost_model": {"a": 0.02, "b": 1.0}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_balance")
    return {
        "lb-mini": run_ranks(balanced_trainer_run, 2, "odc", str(root / "mini"), LB_MINI, STEPS, timeout=300),
        "lb-micro": run_ranks(balanced_trainer_run, 2, "odc", str(root / "micro"), dict(LB_MINI, policy="lb-micro"),
                              STEPS, timeout=300),
        "zero3": run_ranks(balanced_trainer_run, 2, 3, str(root / "zero3"), None, STEPS, timeout=300),
        "single": run_ranks(balanced_trainer_run, 1, None, str(root / "single"), None, STEPS, 4, 2, 2,
                            timeout=300),
    }


def _assert_same_weights(run, reference, what):
    assert sorted(run["weights"]) == sorted(reference["weights"]) == list(range(1, STEPS + 1))
    for step, params in reference["weights"].items():
        for name, tensor in params.items():
            # fp32 sums in another order and micro-batches of other shapes (padding): rounding only
            torch.testing.assert_close(run["weights"][step][name], tensor, rtol=1e-4, atol=2e-5,
                                       msg=f"{what}, step {step}, {name}")


def test_lb_mini_gives_ranks_different_micro_batch_counts(runs):
    mini = runs["lb-mini"]
    assert all(r["engine"] == "ODCEngine" for r in mini)
    per_rank = [r["counts"] for r in mini]
    assert all(len(c) == STEPS for c in per_rank)
    assert any(a != b for a, b in zip(*per_rank)), f"every step had equal counts: {per_rank}"
    # the Trainer without the balance block: gradient_accumulation_steps micro-batches everywhere
    per_epoch = [2] * 6 + [1]  # the epoch's last step has one batch per rank
    assert all(c == (per_epoch * 2)[:STEPS] for c in (r["counts"] for r in runs["zero3"]))


def test_lb_micro_runs_equal_counts_through_the_same_path(runs):
    counts = [r["counts"] for r in runs["lb-micro"]]
    assert counts[0] == counts[1]


def test_lb_micro_slots_run_on_zero3_too_and_lb_mini_there_is_refused(runs, tmp_path):
    """The benchmark's baseline: ZeRO-3 fed LB-Micro slots (equal counts, so its collectives line up)."""
    micro = run_ranks(balanced_trainer_run, 2, 3, str(tmp_path / "z3micro"), dict(LB_MINI, policy="lb-micro"), STEPS,
                      timeout=300)
    assert micro[0]["engine"] == "DeepSpeedEngine" and micro[0]["counts"] == micro[1]["counts"] == \
        runs["lb-micro"][0]["counts"]
    _assert_same_weights(micro[0], runs["zero3"][0], "ZeRO-3 + LB-Micro slots vs ZeRO-3")
    with pytest.raises(Exception, match="lb-mini.*needs the odc stage"):
        run_ranks(balanced_trainer_run, 2, 3, str(tmp_path / "z3mini"), LB_MINI, STEPS, timeout=300)


@pytest.mark.parametrize("policy", ["lb-mini", "lb-micro"])
def test_every_step_equals_zero3_and_a_single_process_on_the_same_samples(runs, policy):
    balanced = runs[policy][0]
    _assert_same_weights(balanced, runs["zero3"][0], f"{policy} vs ZeRO-3")
    _assert_same_weights(balanced, runs["single"][0], f"{policy} vs one process")
    # Adam hides a wrong gradient scale from the weights; the gradient norm and the loss show it
    for reference in (runs["zero3"][0], runs["single"][0]):
        for mine, theirs in zip(balanced["logs"], reference["logs"], strict=True):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_evaluation_and_save_model_keep_working_with_the_balance_block(runs):
    balanced, zero3 = runs["lb-mini"][0], runs["zero3"][0]
    assert balanced["eval_loss"] == pytest.approx(zero3["eval_loss"], rel=1e-4)
    # one process: its weights differ from the distributed runs' by fp32 rounding (~1e-4 relative, see above)
    assert balanced["eval_loss"] == pytest.approx(runs["single"][0]["eval_loss"], rel=1e-3)
    assert balanced["saved"].keys() == zero3["saved"].keys()
    for name, tensor in zero3["saved"].items():
        torch.testing.assert_close(balanced["saved"][name], tensor, rtol=1e-4, atol=2e-5, msg=name)
        torch.testing.assert_close(balanced["saved"][name], balanced["weights"][STEPS][name], msg=name)


def test_logs_show_each_ranks_micro_batches_and_utilisation(runs):
    logs = runs["lb-mini"][0]["logs"]
    assert len(logs) == STEPS
    counts = [r["counts"] for r in runs["lb-mini"]]
    for step, entry in enumerate(logs):
        assert entry["odc_micro_batches"] == f"{counts[0][step]}/{counts[1][step]}"
        assert 0 < entry["odc_planned_utilisation"] <= 1
        assert 0 < entry["odc_utilisation"] <= 1 and len(entry["odc_utilisation_per_rank"].split("/")) == 2


@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "padding-free"])
def test_sft_trainer_with_balance_equals_zero3_and_a_single_process(tmp_path, padding_free):
    pytest.importorskip("trl")
    from tests.support.hf_balance_workloads import sft_run

    balance = dict(LB_MINI, token_cap=50 if padding_free else 48)  # caps at which some step's counts differ
    mini = run_ranks(sft_run, 2, "odc", str(tmp_path / "mini"), balance, padding_free, STEPS, timeout=300)
    zero3 = run_ranks(sft_run, 2, 3, str(tmp_path / "zero3"), None, padding_free, STEPS, timeout=300)
    single = run_ranks(sft_run, 1, None, str(tmp_path / "single"), None, padding_free, STEPS, 4, 2, 2, timeout=300)
    assert any(a != b for a, b in zip(mini[0]["counts"], mini[1]["counts"])), [r["counts"] for r in mini]
    for reference, what in ((zero3[0], "ZeRO-3"), (single[0], "one process")):
        _assert_same_weights(mini[0], reference, f"SFT {what}")
        for mine, theirs in zip(mini[0]["logs"], reference["logs"], strict=True):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


def test_a_balance_block_next_to_stage_3_is_the_marker_form_and_one_next_to_stage_2_is_refused(tmp_path):
    """An odc block next to ``"stage": 3`` asks for the odc stage (the marker form: transformers and accelerate
    keep seeing stage 3); next to another stage it is refused at TrainingArguments, naming the field."""
    from transformers import TrainingArguments
    from transformers.integrations import is_deepspeed_zero3_enabled

    import ds_odc  # noqa: F401  (what the autoload does in a user's script)
    from ds_odc.errors import ODCConfigError
    from tests.support.hf_balance_workloads import balance_ds_config

    config = balance_ds_config(3, None)
    config["zero_optimization"]["odc"] = {"balance": LB_MINI}
    args = TrainingArguments(output_dir=str(tmp_path), deepspeed=config, use_cpu=True, report_to="none")
    ds_config = args.hf_deepspeed_config.config
    assert is_deepspeed_zero3_enabled() and ds_config["zero_optimization"]["stage"] == 3
    assert ds_config["odc"]["balance"]["token_cap"] == LB_MINI["token_cap"]
    config = balance_ds_config(3, None)
    config["zero_optimization"].update(stage=2, odc={"balance": LB_MINI})
    with pytest.raises(ODCConfigError, match=r"zero_optimization\.odc is set but zero_optimization\.stage=2"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=config, use_cpu=True, report_to="none")


def test_resume_mid_epoch_continues_with_the_same_samples_and_losses(runs, tmp_path):
    """Seven steps make an epoch here; the checkpoint at step 2 is mid-epoch. The resumed run skips the
    slots already trained and must see the same samples, hence the uninterrupted run's losses."""
    # arguments: balance, steps, per_device, accumulation, world, collator, resume_from, save_steps
    first = run_ranks(balanced_trainer_run, 2, "odc", str(tmp_path / "first"), LB_MINI, STEPS, 4, 2, None,
                      None, None, 2, timeout=300)
    resumed = run_ranks(balanced_trainer_run, 2, "odc", str(tmp_path / "resumed"), LB_MINI, STEPS, 4, 2, None,
                        None, str(tmp_path / "first" / "checkpoint-2"), timeout=300)
    uninterrupted = runs["lb-mini"][0]
    assert first[0]["losses"] == pytest.approx(uninterrupted["losses"], rel=1e-6)
    assert sorted(resumed[0]["losses"]) == list(range(3, STEPS + 1))
    for step, loss in resumed[0]["losses"].items():
        assert loss == pytest.approx(uninterrupted["losses"][step], rel=1e-6), step
    for step in range(3, STEPS + 1):
        for name, tensor in uninterrupted["weights"][step].items():
            torch.testing.assert_close(resumed[0]["weights"][step][name], tensor, rtol=1e-6, atol=1e-7)
    assert [r["counts"] for r in resumed] == [r["counts"][2:] for r in runs["lb-mini"]]


def test_a_measured_cost_model_plans_alike_everywhere_and_leaves_no_gradient_behind(runs, tmp_path):
    """"measure" times forward+backward passes when training starts: every rank must then plan with the
    same fit (else samples would be lost or run twice) and the timing passes' gradients must be gone
    before step 1 (else the first update would differ from ZeRO-3's)."""
    measured = run_ranks(balanced_trainer_run, 2, "odc", str(tmp_path / "measured"),
                         dict(LB_MINI, cost_model="measure"), STEPS, timeout=300)
    _assert_same_weights(measured[0], runs["zero3"][0], "measured cost model vs ZeRO-3")
    for mine, theirs in zip(measured[0]["logs"], runs["zero3"][0]["logs"], strict=True):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)



def test_activation_offload_under_the_balance_block_with_a_measured_cost_model_equals_zero3(runs, tmp_path):
    """Micro-batches whose token count exceeds the budget offload (what the policy plans for them), the measured
    cost model adds the transfer it cannot hide, and every step still equals ZeRO-3's."""
    offload = {"budget_mb": BUDGET_MB}
    run = run_ranks(balanced_trainer_run, 2, "odc", str(tmp_path / "offload"), dict(LB_MINI, cost_model="measure"),
                    STEPS, 4, 2, None, None, None, 0, 0, offload, timeout=300)
    _assert_same_weights(run[0], runs["zero3"][0], "activation offload vs ZeRO-3")
    for rank in run:
        # the plan's bytes come from a per-token profile calibrated on the first (3-token) forward; a Llama's
        # saved sizes are not all linear in tokens, so bytes are an estimate here (exact where they are linear:
        # tests/distributed/test_activation_offload.py); what moves is the planned tensors, and about the bytes
        for tokens, moved, planned in rank["offloaded"]:
            assert abs(moved - planned) <= 0.1 * planned, (tokens, moved, planned)
        moved = [tokens for tokens, moved, _ in rank["offloaded"] if moved]
        assert moved and len(moved) < len(rank["offloaded"]), "expected some micro-batches to offload, not all"


def test_a_stalled_rank_is_named_within_timeout_s_in_the_balance_s_exchanges_between_steps(tmp_path):
    """The balance's exchanges between steps (loss-token count, logged utilisation) are ODC rounds: a peer
    that stops there is named within ``timeout_s``, not after the process group's timeout (60 s here;
    10 minutes by default), which a collective gather would wait out."""
    report = run_ranks(stalled_peer_during_the_step_exchanges, 2, 1, str(tmp_path), 5.0, report=True,
                       wait_for=[0], timeout=150, pg_timeout_s=60)
    status, outcome = report.outcomes[0]
    assert status == "ok", outcome
    assert outcome["error"] == "ODCTimeoutError" and "rank 1" in outcome["message"], outcome
    assert "made no progress" in outcome["message"], outcome
    assert 5.0 <= outcome["after_s"] < 5.0 + 15.0, outcome
