"""Long samples split over aligned groups (policy "lb-mini-split") on 4 CPU ranks: a split micro-batch runs
over its group with Ulysses attention, every other rank goes on with its own micro-batches, and the members
meet only inside it. Every step equals one process on the same samples (per-token); a member out of step,
or one that dies inside an all-to-all, is named on every rank."""
import pytest
import torch

from tests.support import split_workloads as split
from tests.support.harness import run_ranks


def _assert_every_step_equal(odc, expected, tolerance=2e-6):
    for rank in range(4):
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], expected["params"], strict=True)):
            worst = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
            assert worst <= tolerance, f"rank {rank}, step {step}: {worst}"


def test_one_sample_split_over_two_ranks_the_rest_whole_equals_one_process_with_a_frozen_reference():
    """3 steps: one sample split over ranks 0-1 (then 2-3, then a packed pair over 0-1 and one over 2-3), the
    others whole and packed, ranks at 0-2 whole micro-batches. Per-token loss, each member passing its slice's
    sum and tokens: every step's parameters equal one process's on the same samples. A frozen reference model
    (built before the policy, as TRL builds a DPO reference) runs inside every micro-batch: in a split one it
    meets the members in all-to-alls too, and its logits of each slice are the whole sequence's."""
    odc = run_ranks(split.train, 4, 3, False, True, timeout=300)
    expected = split.one_process(3)
    _assert_every_step_equal(odc, expected)
    assert odc[0]["counts"] == [[2, 1], [1, 1], [2, 1]]  # rank 0's entries each step (members of each)
    assert [[len(odc[rank]["counts"][step]) for rank in range(4)] for step in range(3)] == \
        [[2, 1, 2, 1], [2, 1, 1, 2], [2, 2, 1, 1]]  # micro-batches per rank: uneven
    # global_samples counts each micro-batch of the plans once, a split one too (not once per member)
    planned = [len(split.plan(step).splits) + sum(map(len, split.plan(step).whole)) for step in range(3)]
    expected_samples = [sum(planned[:step + 1]) for step in range(3)]
    assert [odc[rank]["global_samples"] for rank in range(4)] == [expected_samples] * 4, planned
    seen = 0
    for rank in range(4):
        for step, sequence, part, logits in odc[rank]["reference_logits"]:
            whole = expected["split_logits"][(step, sequence)]
            half = -(-whole.shape[1] // 2)
            torch.testing.assert_close(logits[:, : whole.shape[1] - part * half], whole[:, part * half:][:, :half],
                                       rtol=1e-5, atol=1e-5)
            seen += 1
    assert seen == 2 * 4  # four split micro-batches, two slices each


def test_with_activation_checkpointing():
    """Checkpointed decoder layers recompute their attention in backward, inside the split micro-batch: over
    the same group, equal to one process every step."""
    odc = run_ranks(split.train, 4, 3, True, False, timeout=300)
    _assert_every_step_equal(odc, split.one_process(3))


@pytest.mark.parametrize("kind", ["skip", "extra"])
def test_a_member_out_of_step_is_named_on_every_rank(kind):
    """"skip": rank 1 skips split micro-batch 0 and goes to the step while rank 0 waits for it; "extra": rank 2
    runs a split micro-batch its plan does not give it while rank 3 goes on to its own. Every rank raises at
    once (well within the 30 s bound), naming the split micro-batch, its ranks and what each member did."""
    errors = run_ranks(split.mismatch, 4, kind, 30.0, timeout=60)
    if kind == "skip":
        expected = ("split micro-batch 0 (ranks 0, 1): rank 0 started it in step 2 while rank 1 went to the step "
                    "fence (engine.step) after 0 micro-batches")
    else:
        expected = ("split micro-batch 1 (ranks 2, 3): rank 2 started it in step 2 while rank 3 had gone on to its "
                    "own micro-batches")
    for rank in range(4):
        assert expected in errors[rank], (rank, errors[rank])


def test_a_member_killed_inside_an_all_to_all_is_named_by_every_survivor():
    """Rank 1 dies entering the second decoder layer of its split micro-batch in step 2, while rank 0 sits in
    that layer's all-to-all with it: every survivor names rank 1 (rank 0 from the collective's error, ranks 2
    and 3 at their next wait), well within the bound (30 s; the process group's 60 s; the harness waits 55 s)."""
    report = run_ranks(split.killed_inside, 4, 1, 30.0, timeout=55, report=True, pg_timeout_s=60)
    assert not [r for r in report.hung_ranks if r != 1], report.hung_ranks
    for rank in (0, 2, 3):
        status, error = report.outcomes[rank]
        assert status == "ok" and error.startswith("ODCPeerError: rank 1 ") and " exited " in error, (rank, error)
    assert "split micro-batch 0 (ranks 0, 1)" in report.outcomes[0][1]


def test_the_trainer_balance_block_with_the_split_policy_equals_one_process(tmp_path):
    """An unmodified Trainer on 2 ranks, ``"policy": "lb-mini-split"`` in its balance block, packed micro-batches
    (``DataCollatorWithFlattening``): the plan runs some steps' samples split over both ranks and others whole, and
    every step takes the same samples as the Trainer without the block; weights and logged losses equal one plain
    process's on those samples (per-token, the Trainer's own loss-token count)."""
    odc = run_ranks(split.split_trainer_run, 2, "odc", str(tmp_path / "odc"), timeout=300)
    single = run_ranks(split.split_trainer_run, 1, None, str(tmp_path / "single"), timeout=300)[0]
    assert {r["engine"] for r in odc} == {"ODCEngine"}
    assert sum(c["split"] for c in odc[0]["counts"]) > 0 and sum(c["whole"] for r in odc for c in r["counts"]) > 0
    assert [c["split"] for c in odc[0]["counts"]] == [c["split"] for c in odc[1]["counts"]]  # members: the same
    assert sorted(single["grad_norms"]) == [1, 2, 3]
    for rank in range(2):
        assert odc[rank]["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert odc[rank]["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-4)  # the gradient's scale
        for step, params in single["weights"].items():
            for name, tensor in params.items():
                torch.testing.assert_close(odc[rank]["weights"][step][name], tensor, rtol=1e-4, atol=2e-5,
                                           msg=lambda m, step=step, name=name: f"step {step}, {name}: {m}")


@pytest.mark.parametrize("variant", ["no loss kwargs", "local tokens"])
def test_a_trainer_whose_loss_would_be_a_mean_per_slice_is_refused_at_its_first_iteration_on_every_rank(
        variant, tmp_path):
    """The Trainer's loss adds up over a split micro-batch's slices only when it is normalised by the step's global
    loss-token count. A model that does not take num_items_in_batch (its loss a mean per micro-batch), or
    average_tokens_across_devices=False (each rank its own count), is refused when the loader first plans, on
    every rank, before any micro-batch runs."""
    odc = run_ranks(split.split_trainer_run, 2, "odc", str(tmp_path / "odc"), 3, 2, variant, timeout=300)
    expected = ("does not take it (transformers' causal LMs do) and no compute_loss_func is given"
                if variant == "no loss kwargs" else "needs average_tokens_across_devices=True")
    for rank in range(2):
        error = odc[rank]["error"]
        assert error is not None and error.startswith("ODCConfigError: zero_optimization.odc.balance.policy "
                                                      "'lb-mini-split' with the Trainer needs "), error
        assert expected in error, error
        assert odc[rank]["counts"] == [] and odc[rank]["weights"] == {}  # not one step ran


def test_a_group_the_model_heads_do_not_allow_is_refused_at_initialize_by_name():
    errors = run_ranks(split.refused_heads, 2, timeout=120)
    for error in errors:
        assert error.startswith("ODCConfigError: zero_optimization.odc.balance.max_group=4: the model has 6 query "
                                "heads and 6 key/value heads"), error
        assert "the largest group these heads allow is 2" in error


@pytest.mark.parametrize("route", ["token", "scaled", "torch token", "torch scaled", "mean", "torch mean",
                                   "mean rule"])
def test_every_backward_route_in_a_split_micro_batch_weighs_the_sample_as_whole_or_is_refused_before_a_push(route):
    """Sample 0 split over ranks 0-1, the rest whole, each backward by ``route``. A loss that adds up over the
    slices (the per-token rule, or the caller's token sum over the step's count declared with
    ``scaled_token_sum=True``; by ``engine.backward`` or torch-style ``loss.backward()``) gives every step the
    parameters one process gets on the samples whole. A mean over the slice (the caller's with
    gradient_accumulation_steps 1, torch-style, or the mean rule of managed accumulation) is refused by name on
    both members before any gradient reaches an owner; the micro-batch then runs again per-token and the steps
    still equal one process's."""
    odc = run_ranks(split.routes, 2, route, timeout=240)
    expected = split.route_reference(2)
    for rank in range(2):
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], expected, strict=True)):
            worst = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
            assert worst <= 2e-6, f"{route}: rank {rank}, step {step}: {worst}"
        if route not in split.REFUSED_ROUTES:
            assert odc[rank]["error"] is None, odc[rank]["error"]
            continue
        error = odc[rank]["error"]
        assert error is not None and error.startswith("ODCConfigError: split micro-batch 0 (ranks 0, 1): "), error
        assert "would count the sample once per member" in error
        assert ("loss.backward()" if route == "torch mean" else "engine.backward()") in error
        before, after = odc[rank]["pushes"]
        assert before == after, (route, rank, before, after)  # nothing reached an owner


def test_forwards_outside_every_entry_with_a_late_member_never_fail_the_job():
    """A frozen reference model's forwards before the entries, training-engine evaluations between and after them,
    rank 1 late by 300 ms before each: no false mismatch, and every step equals one process."""
    odc = run_ranks(split.outside_forwards, 2, 0.3, 2, timeout=240)
    expected = split.route_reference(2)
    for rank in range(2):
        assert odc[rank]["forwards_outside"] > 0
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], expected, strict=True)):
            worst = max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)
            assert worst <= 2e-6, f"rank {rank}, step {step}: {worst}"


def test_split_groups_die_with_their_engine_and_a_second_split_engine_is_refused_by_name():
    """Three build-destroy cycles of a split engine: threads and open descriptors (gloo's workers and sockets)
    stay where the first cycle left them. A second training engine with the split policy while the first lives is
    refused at initialize, naming why, on every rank."""
    result = run_ranks(split.rebuilds, 2, 3, timeout=240)
    for rank in range(2):
        assert result[rank]["error"] is not None and result[rank]["error"].startswith(
            "ODCConfigError: balance policy 'lb-mini-split': this process already has a training engine with the "
            "split policy"), result[rank]["error"]
        counts = result[rank]["counts"]
        assert counts[-1][0] <= counts[0][0] and counts[-1][1] <= counts[0][1], counts
