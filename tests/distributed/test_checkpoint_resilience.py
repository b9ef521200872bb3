"""Checkpoints survive a crash in the middle of a save, and move between world sizes (N -> M ranks)
through DeepSpeed's universal checkpoint, with the optimizer state."""
import os

import pytest

from tests.support.checkpoint_workloads import (
    RESHARD_TOLERANCE,
    load_and_continue,
    load_latest,
    merged_losses,
    save_then_crash_mid_save,
    to_universal,
    train_and_save,
)
from tests.support.compare import worst_rel_diff
from tests.support.harness import RankFailure, run_ranks


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    report = run_ranks(save_then_crash_mid_save, 2, ckpt, 1, timeout=60, report=True, wait_for=[0])
    status, outcome = report.outcomes[0]
    assert status == "ok" or 0 in report.hung_ranks, outcome
    assert os.path.exists(os.path.join(ckpt, "global_step3")), "the second save did not start"
    with open(os.path.join(ckpt, "latest")) as latest:
        assert latest.read() == "global_step2"
    assert not [name for name in os.listdir(ckpt) if name.startswith(".latest.")]
    loaded = run_ranks(load_latest, 2, ckpt)
    assert loaded[0]["path"] and "global_step2" in loaded[0]["path"]
    if status == "ok":
        assert worst_rel_diff(loaded[0]["loaded"], outcome["saved"]) == 0.0


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 1), (1, 2)])
def test_checkpoint_moves_between_world_sizes_with_optimizer_state(tmp_path, saved_world, loaded_world):
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(train_and_save, saved_world, ckpt)
    # without conversion: an error that says how to convert, not DeepSpeed's missing-file error
    with pytest.raises(RankFailure, match=rf"saved by {saved_world} data-parallel ranks, this job has "
                                          rf"{loaded_world}[\s\S]*ds_to_universal"):
        run_ranks(load_and_continue, loaded_world, ckpt, "saved", 3, 2, False)
    universal_tag = to_universal(ckpt, "saved")
    resumed = run_ranks(load_and_continue, loaded_world, ckpt, universal_tag)

    rank0 = resumed[0]
    assert rank0["engine"] == "ODCEngine"
    # every weight, frozen ones included, comes back bit-exact at the new world size
    assert worst_rel_diff(rank0["loaded"], uninterrupted[0]["saved"]) == 0.0
    assert rank0["loaded_adam_step"] == 3.0 and rank0["global_steps"] == 5
    assert rank0["lr"] == uninterrupted[0]["lr"]  # the warmup scheduler's state came along
    # the same global batch after resuming gives the updates of the uninterrupted run: this needs
    # Adam's moments (a fresh optimizer state moves every weight by ~lr in the first step)
    assert worst_rel_diff(rank0["final"], uninterrupted[0]["final"]) < RESHARD_TOLERANCE
    expected, got = merged_losses(uninterrupted), merged_losses(resumed)
    for step in (3, 4):
        for slot, loss in expected[step].items():
            assert got[step][slot] == pytest.approx(loss, rel=RESHARD_TOLERANCE), (step, slot)
