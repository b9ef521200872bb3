"""The Trainer balance block's other divisors (docs/balancing.md, "Normalisation, as the Trainer means it"),
under lb-mini with uneven micro-batch counts on 2 CPU ranks, step by step against one plain PyTorch process
that applies the documented divisor to the same assignment of samples to ranks:

* ``average_tokens_across_devices=False``: each rank's micro-batches divided by that rank's own loss-token
  count, the ranks averaged;
* a model that reports no token count (its forward takes no ``num_items_in_batch``): each micro-batch's mean
  loss divided by the step's global micro-batch count over the world size (the mean over all micro-batches).

The logged (pre-clip) ``grad_norm`` shows a wrong scale, which Adam and clipping hide from the weights; the
weights show a wrong weighting between ranks or micro-batches.
"""
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.support.harness import run_ranks  # noqa: E402
from tests.support.hf_balance_divisor_workloads import divisor_run, documented_reference, loss_tokens  # noqa: E402

STEPS = 3
SAMPLES_PER_STEP = 16  # 4 per device x 2 accumulation steps x 2 ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_balance_divisors")
    return {
        "per-rank": run_ranks(divisor_run, 2, str(root / "per_rank"), True, False, STEPS, timeout=300),
        "micro-batches": run_ranks(divisor_run, 2, str(root / "no_count"), False, True, STEPS, timeout=300),
    }


def _check_against_the_reference(ranks, divisor):
    assert all(r["engine"] == "ODCEngine" for r in ranks)
    per_rank = [r["ran"] for r in ranks]
    assert all(len(steps) == STEPS for steps in per_rank)
    counts = [[len(step) for step in steps] for steps in per_rank]
    assert any(a != b for a, b in zip(*counts)), f"every step had equal counts: {counts}"
    for step in range(STEPS):  # the step's global minibatch, every sample run once
        assert sum(len(b["input_ids"]) for steps in per_rank for b in steps[step]) == SAMPLES_PER_STEP
    reference = documented_reference(per_rank, divisor)
    logs = ranks[0]["logs"]
    assert len(logs) == STEPS
    for step, (entry, norm) in enumerate(zip(logs, reference["grad_norms"]), start=1):
        assert entry["grad_norm"] == pytest.approx(norm, rel=1e-4), f"{divisor}, step {step}"
    assert sorted(ranks[0]["weights"]) == sorted(reference["weights"]) == list(range(1, STEPS + 1))
    for step, params in reference["weights"].items():
        for name, tensor in params.items():
            # fp32 sums in another order and micro-batches of other shapes (padding): rounding only
            torch.testing.assert_close(ranks[0]["weights"][step][name], tensor, rtol=1e-4, atol=2e-5,
                                       msg=f"{divisor}, step {step}, {name}")
    return counts


def test_without_average_tokens_across_devices_each_rank_divides_by_its_own_token_count(runs):
    ranks = runs["per-rank"]
    assert all(r["accepts_loss_kwargs"] for r in ranks)
    _check_against_the_reference(ranks, "per-rank")
    # the model is given its own rank's loss-token count, which differs between the ranks
    for rank in ranks:
        for step, (batches, given) in enumerate(zip(rank["ran"], rank["given"]), start=1):
            own = sum(loss_tokens(b) for b in batches)
            assert given == [own] * len(batches), f"step {step}: {given}, own count {own}"
    own_counts = [[sum(loss_tokens(b) for b in step) for step in r["ran"]] for r in ranks]
    assert own_counts[0] != own_counts[1]


def test_a_model_without_a_token_count_is_divided_by_the_global_micro_batch_count_over_the_world(runs):
    ranks = runs["micro-batches"]
    assert not any(r["accepts_loss_kwargs"] for r in ranks)
    assert all(count is None for r in ranks for given in r["given"] for count in given)
    _check_against_the_reference(ranks, "micro-batches")
