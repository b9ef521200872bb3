"""Sliding-window models under the split policy on 2 CPU ranks: a tiny Mistral (every layer slides) and a tiny
Qwen2 with a layer mix (one full layer, one sliding), trained with samples split over the ranks and packed whole,
equal one process running each sample alone with the model's own mask, every step."""
import functools

import pytest

from tests.support import window_workloads as windows
from tests.support.harness import run_ranks

TOLERANCE = 2e-6


def _worst(ours: dict, theirs: dict) -> float:
    return max(float((ours[name] - theirs[name]).abs().max()) for name in theirs)


@functools.lru_cache(maxsize=None)
def _one_process(kind: str, windowed: bool = True) -> dict:
    return windows.one_process(kind, 2, windowed=windowed)


@pytest.fixture(scope="module")
def odc():
    return run_ranks(windows.train, 2, 2, timeout=300)


@pytest.mark.parametrize("kind", windows.KINDS)
def test_split_and_packed_samples_keep_their_window_equal_to_one_process(odc, kind):
    """Two steps: one sample split over ranks 0-1 (its gathered sequence has no mask), then two packed samples
    split over them; whole micro-batches packed (each sample within itself, no mask) and alone (the model's own
    mask). Per-token loss: every step's parameters equal one process's, each sample alone, unpacked."""
    expected = _one_process(kind)
    for rank in range(2):
        for step, (ours, theirs) in enumerate(zip(odc[rank][kind], expected["params"], strict=True)):
            worst = _worst(ours, theirs)
            assert worst <= TOLERANCE, f"{kind}: rank {rank}, step {step}: {worst}"
    # the plans ran as written: split alone, split packed, whole packed and whole alone
    assert sorted({entry for rank in range(2) for entry in odc[rank]["entries"]}) == \
        [(0, False, (1, 2)), (0, False, (3,)), (0, True, (0,)), (1, False, (2,)), (1, False, (3, 4)),
         (1, True, (0, 1))]


@pytest.mark.parametrize("kind", windows.KINDS)
def test_the_window_matters_on_these_lengths(kind):
    """Full attention (what the split policy computed before it honoured windows) gives other logits on these
    samples and other parameters, far beyond the tolerance: the comparison above would fail without windows."""
    windowed, full = _one_process(kind), _one_process(kind, False)
    for index, (a, b) in enumerate(zip(windowed["logits"], full["logits"], strict=True)):
        differs = float((a - b).abs().max())
        assert differs > 1e-3, (kind, index, differs)
    for step, (a, b) in enumerate(zip(windowed["params"], full["params"], strict=True)):
        assert _worst(a, b) > 100 * TOLERANCE, (kind, step)
