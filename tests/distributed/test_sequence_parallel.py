"""Ulysses sequence parallelism (DeepSpeed ALST's ``mpu`` route) on the odc stage: 4 CPU ranks, 2 SP groups
of 2. Parameters are partitioned, pulled and pushed over the whole world, as ZeRO-3 + SP does; the ranks of
one SP group run the same micro-batches, different SP groups may run different counts."""
import pytest

from tests.support import sp_workloads as sp
from tests.support.harness import run_ranks


def _worst(ours: dict, theirs: dict) -> float:
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


@pytest.mark.parametrize("alst", [False, True], ids=["plain", "checkpointing-tiled-mlp-tiled-loss"])
def test_sp_groups_running_1_and_3_micro_batches_equal_one_process(alst):
    """Per-token loss, each SP rank reporting its own shard's tokens: the update of one process on the full
    sequences of the step, every step. Also with ALST's other parts: activation checkpointing, TiledMLP (its
    gradients held back until the last tile, ``ds_grad_is_ready``) and the tiled logits loss (whose backward
    runs inside the forward, so the head's gradient is pushed there)."""
    counts = (1, 3)
    odc = run_ranks(sp.train_per_token, 4, counts, 3, alst, timeout=300)
    expected = sp.reference_per_token(counts, 3)
    for rank in range(4):
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], expected, strict=True)):
            assert _worst(ours, theirs) <= 2e-6, f"rank {rank}, step {step}"
    assert odc[0]["micro_batches"] == 2 * sum(counts)  # every SP rank's backward is one micro-batch of the fence
    assert odc[0]["global_samples"] == 3 * sum(counts)  # samples count SP groups, not ranks


def test_a_micro_batch_count_mismatch_inside_an_sp_group_is_named_on_every_rank():
    """Rank 1 starts a third micro-batch while its SP partner, rank 0, goes to the step: instead of rank 1
    waiting inside Ulysses' all-to-all and rank 0 at the fence until the no-progress bound, every rank
    raises at once, naming the SP group and both counts."""
    errors = run_ranks(sp.mismatch_in_group, 4, 1, 60.0, timeout=50)
    for rank in range(4):
        assert "sequence-parallel group 0 (ranks 0, 1)" in errors[rank], errors[rank]
        assert "rank 1 started micro-batch 3 of step 1 while rank 0 went to the step fence (engine.step) after 2 " \
               "micro-batches" in errors[rank], errors[rank]


@pytest.mark.parametrize("inside", [False, True], ids=["before-the-forward", "inside-an-all-to-all"])
def test_an_sp_peer_killed_is_named_by_every_survivor(inside):
    """Rank 1 is killed at its second micro-batch of step 2: its SP partner (rank 0) waits for it before that
    forward, or sits inside an all-to-all with it; the other SP group at the fence. Each survivor names rank 1
    well within the bound (``timeout_s`` 30 s; the process group's 60 s; the harness waits 55 s)."""
    report = run_ranks(sp.killed_in_group, 4, 1, inside, 30.0, timeout=55, report=True, pg_timeout_s=60)
    assert not [r for r in report.hung_ranks if r != 1], report.hung_ranks
    for rank in (0, 2, 3):
        status, error = report.outcomes[rank]
        assert status == "ok" and error.startswith("ODCPeerError: rank 1 ") and " exited " in error, (rank, error)
    assert "sequence-parallel group 0 (ranks 0, 1)" in report.outcomes[0][1]


def test_equal_counts_match_zero3_with_sp_every_step():
    """HF's gathered token-mean loss (``deepspeed_sp_compute_loss``'s shape), DeepSpeed's managed accumulation
    of 2 micro-batches: losses and parameters equal ZeRO-3 + SP's, every step, and samples count SP groups."""
    zero3 = run_ranks(sp.train_gathered_mean, 4, 3, 2, 2, timeout=300)
    odc = run_ranks(sp.train_gathered_mean, 4, "odc", 2, 2, timeout=300)
    for rank in range(4):
        assert odc[rank]["losses"] == zero3[rank]["losses"], rank
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], zero3[rank]["params"], strict=True)):
            assert _worst(ours, theirs) <= 1e-6, f"rank {rank}, step {step}"
        # steps x accumulation x SP groups
        assert odc[rank]["global_samples"] == zero3[rank]["global_samples"] == 2 * 2 * 2


def test_a_frozen_reference_model_under_sp_takes_the_lockstep_too():
    """DPO's shape: the frozen reference model (built by TRL without the mpu, before the policy) runs ALST's
    attention too. SP groups at 1 and 3 micro-batches per step train as one process; and rank 1 starting one
    micro-batch more than its partner is named at its reference model's forward, the first all-to-all it would
    have entered, on every rank."""
    counts = (1, 3)
    odc = run_ranks(sp.with_reference, 4, counts, timeout=300)
    expected = sp.reference_per_token(counts, 2)
    for rank in range(4):
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], expected, strict=True)):
            assert _worst(ours, theirs) <= 2e-6, f"rank {rank}, step {step}"
    errors = run_ranks(sp.with_reference, 4, (2, 2), 1, timeout=120)
    for result in errors:
        assert "rank 1 started micro-batch 3 of step 1 while rank 0 went to the step fence" in result["error"], result


def test_outside_the_sp_groups_no_collective_per_micro_batch_and_none_per_step():
    """On ODC the only collectives of forward/backward are Ulysses' own, inside each SP group (and the loss's
    gather there); the step meets through the transport. ZeRO-3 + SP gathers and reduce-scatters over the
    world in every forward/backward."""
    odc = run_ranks(sp.count_sp_collectives, 4, "odc", setup=sp.install_grouped_counter, timeout=300)
    zero3 = run_ranks(sp.count_sp_collectives, 4, 3, setup=sp.install_grouped_counter, timeout=300)
    for rank in range(4):
        assert all(inside > 0 and outside == 0 for inside, outside in odc[rank]["fwd_bwd"]), odc[rank]
        assert odc[rank]["step"] == [(0, 0)] * 2, odc[rank]
        assert all(outside > 0 for _, outside in zero3[rank]["fwd_bwd"]), zero3[rank]


def test_attention_forms_alst_would_drop_are_refused_by_name_on_every_rank():
    """ALST runs sdpa without the model's mask: a sliding window, or samples packed into one sequence, would be
    attended over in full, silently (on ZeRO-3 too). The sliding window is refused at initialize; packed samples at
    the forward that has them, before any all-to-all, by the rank that sees the restart, and its partner names it."""
    errors = run_ranks(sp.attention_forms_alst_drops, 2, timeout=240)
    for rank in range(2):
        assert errors[rank]["window"].startswith("ODCConfigError: fixed sequence parallelism (ALST's mpu) would "
                                                 "lose the model's sliding window at every layer: sliding_window=4 "
                                                 "with attn_implementation='sdpa'"), errors[rank]
    for case, seen_by in (("boundary", 1), ("inside", 0)):
        for rank in range(2):
            assert f"rank {seen_by} of sequence-parallel group 0 (ranks 0, 1): this forward's position_ids restart " \
                   "or skip" in errors[rank][case], (case, rank, errors[rank][case])
        assert errors[seen_by][case].startswith("ODCConfigError"), errors[seen_by][case]
