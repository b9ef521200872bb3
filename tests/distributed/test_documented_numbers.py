"""Documented numbers that no other test could catch breaking (the project's issue 47): the gathered-mean rule under
sequence parallelism at uneven counts (docs/sequence_parallel.md), buffers through the universal checkpoint
(docs/checkpoints.md), and the push bytes the monitor writes under ``deterministic`` (docs/metrics.md)."""
import csv
import glob
import os

import pytest

from tests.support import documented_number_workloads as documented
from tests.support.checkpoint_workloads import RESHARD_TOLERANCE, merged_losses, to_universal
from tests.support.compare import worst_rel_diff
from tests.support.harness import run_ranks


def _worst(ours: dict, theirs: dict) -> float:
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


def test_sp_groups_at_1_and_3_micro_batches_under_the_gathered_mean_rule_equal_one_process():
    """HF's gathered token mean (every SP rank holds its sequence's mean; the backward sums the SP copies), managed
    accumulation, SP groups at 1 and 3 micro-batches, each setting the boundary on its own last one: the step
    divides by the global micro-batch count (8, each SP rank counted), which here is neither a group's own count
    times the world (4 or 12) nor ``gradient_accumulation_steps`` (3) times the world (12), so a divisor taken
    from either would move every parameter off the one-process update under SGD, whose steps show a factor."""
    counts = (1, 3)
    odc = run_ranks(documented.train_gathered_mean_uneven, 4, counts, 3, 2, timeout=300)
    expected = documented.reference_gathered_mean(counts, 2)
    for rank in range(4):
        for step, (ours, theirs) in enumerate(zip(odc[rank]["params"], expected, strict=True)):
            assert _worst(ours, theirs) <= 2e-6, f"rank {rank}, step {step}"
        assert odc[rank]["global_samples"] == 2 * sum(counts)  # samples count SP groups, not ranks


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 1), (1, 2)])
def test_a_universal_load_at_another_world_size_restores_the_buffers_training_updated(tmp_path, saved_world,
                                                                                      loaded_world):
    """DeepSpeed's ZeRO-3 universal load leaves buffers at their initial values; ds_odc restores them from the
    saving ranks' model files. The model's input layer keeps a running average of its weight in buffers, updated in
    forward and scaling its output: the loading ranks (fresh engines, other weights, fresh buffers) hold the saving
    run's buffers bit for bit after the load, and the steps after it give the uninterrupted run's losses, weights
    and buffers (the same global batch, summed in another order)."""
    ckpt = str(tmp_path / "ckpt")
    uninterrupted = run_ranks(documented.buffered_train, saved_world, ckpt, None, 0, 3, 2)
    saved = uninterrupted[0]["saved_buffers"]
    assert all(worst_rel_diff(r["saved_buffers"], saved) == 0.0 for r in uninterrupted)  # equal on every rank
    assert float(saved["inp.average"]) != 0.0  # training moved it away from its initial value
    resumed = run_ranks(documented.buffered_train, loaded_world, ckpt, to_universal(ckpt, "saved"), 3, 2, 0)
    for rank, result in enumerate(resumed):
        assert worst_rel_diff(result["loaded_buffers"], saved) == 0.0, rank
        assert worst_rel_diff(result["final_buffers"], uninterrupted[0]["final_buffers"]) < RESHARD_TOLERANCE, rank
        assert worst_rel_diff(result["final"], uninterrupted[0]["final"]) < RESHARD_TOLERANCE, rank
    expected, got = merged_losses(uninterrupted), merged_losses(resumed)
    for step in (3, 4):
        for slot, loss in expected[step].items():
            assert got[step][slot] == pytest.approx(loss, rel=RESHARD_TOLERANCE), (step, slot)


def _csv_figure(directory: str, name: str) -> list:
    """[(step, value)] of one figure of DeepSpeed's CSV monitor (one file per tag, '/' written as '_')."""
    (path,) = glob.glob(os.path.join(directory, "**", name.replace("/", "_") + ".csv"), recursive=True)
    with open(path) as file:
        return [(int(step), float(value)) for step, value in list(csv.reader(file))[1:]]


def test_push_bytes_are_the_gradient_bytes_handed_to_pushes_with_or_without_deterministic_sums(tmp_path):
    """``ODC/push/..._bytes`` counts the gradient bytes a rank hands to its pushes, what ZeRO-3's reduce-scatters
    take: every micro-batch pushes every trainable gradient once (fp32: 4 bytes an element), so rank 1 at 3
    micro-batches pushes 3 times that. ``deterministic`` changes what reaches the owners' windows (each value as
    two fp64 parts: 4 times an fp32 gradient's bytes), not the figure: the monitor writes the same numbers with
    it on and off."""
    counts, steps = (1, 3), 2
    ranks = run_ranks(documented.push_bytes_with_and_without_deterministic, 2, str(tmp_path), counts, steps,
                      timeout=120)
    for rank, runs in enumerate(ranks):
        assert not runs[False]["exact"] and runs[True]["exact"]  # what each run asked for is what ran
        gradient = runs[False]["gradient_bytes"]
        assert gradient > 0 and runs[True]["gradient_bytes"] == gradient
        for deterministic in (False, True):
            assert runs[deterministic]["push_bytes"] == [counts[rank] * gradient] * steps, (rank, deterministic)
        assert runs[False]["landed_bytes"] == steps * counts[rank] * gradient
        assert runs[True]["landed_bytes"] == 4 * steps * counts[rank] * gradient
    gradient = ranks[0][False]["gradient_bytes"]
    for deterministic in (False, True):
        monitor = str(tmp_path / str(deterministic))
        assert _csv_figure(monitor, "ODC/push/max_bytes") == [(1, 3 * gradient), (2, 3 * gradient)]
        assert _csv_figure(monitor, "ODC/push/mean_bytes") == [(1, 2 * gradient), (2, 2 * gradient)]
