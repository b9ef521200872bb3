"""Ranks with different amounts of work: ODC equals the single-process reference; ZeRO-3 hangs."""
import pytest

from tests.support.compare import movement_distance, worst_rel_diff
from tests.support.harness import run_ranks
from tests.support.workloads import make_model, reference_training, train_uneven, train_uneven_each

TOL = 1e-6
ADAM = {"optimizer": "adam", "clip": 1.0}
# bf16 accumulators' summed gradients against fp32 ones': measured at most 5.6e-3 (three rules, three steps); a
# factor of 2 lands at 1.0, a micro-batch lost at 0.4 or more
BF16_ACCUMULATOR_GRAD_TOL = 2e-2


@pytest.mark.parametrize("mode,counts", [("unmanaged", (1, 3)), ("managed", (1, 3)), ("unmanaged", (0, 3))],
                         ids=["unmanaged-1-3", "managed-1-3", "unmanaged-idle-rank"])
def test_uneven_micro_batch_counts_equal_single_process(mode, counts):
    results = run_ranks(train_uneven, 2, "odc", mode, counts)
    expected = reference_training(mode, counts)
    for rank, result in enumerate(results):
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= TOL, f"rank {rank}: params differ from the single-process reference by {diff:.2e}"
        assert result["phase"] == "idle"
        assert result["global_samples"] == 3 * sum(counts) * 4  # 3 steps, micro-batches of 4 samples


def test_per_token_normalisation_with_unequal_and_zero_tokens():
    counts = (2, 3)
    masked = ((0, 0), (0, 1))  # rank 0 carries no loss token at all
    results = run_ranks(train_uneven, 2, "odc", "token", counts, 3, masked)
    expected = reference_training("token", counts, masked=masked)
    for rank, result in enumerate(results):
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= TOL, f"rank {rank}: params differ from the single-process reference by {diff:.2e}"


@pytest.mark.parametrize("mode", ["unmanaged", "managed", "token"])
def test_a_wrong_divisor_would_exceed_the_bar(mode):
    """The uneven tests (here and across nodes) can fail on a wrong divisor: the reference trained with every
    gradient doubled or halved (a count missed, an idle rank counted) lands far beyond ``TOL``, with the counts
    and masks the two-host tests use too. (Under Adam with clipping, which these tests ran before, both landed
    within it.)"""
    counts, masked = (1, 3, 0, 2), ((0, 0),)
    good = reference_training(mode, counts, masked=masked)
    for scale in (2.0, 0.5):
        assert worst_rel_diff(reference_training(mode, counts, masked=masked, scale=scale), good) > 100 * TOL, scale


def test_zero3_hangs_where_odc_does_not():
    """The same uneven script under ZeRO-3: ranks block in mismatched collectives."""
    report = run_ranks(train_uneven, 2, 3, "unmanaged", (1, 3), timeout=20, report=True)  # ODC: ~3 s
    assert report.hung_ranks, f"ZeRO-3 was expected to hang on uneven micro-batch counts: {report.outcomes}"


@pytest.mark.parametrize("mode,counts,masked", [("unmanaged", (1, 3), ()), ("managed", (3, 1), ()),
                                                ("token", (0, 3), ((1, 0),))],
                         ids=["unmanaged-1-3", "managed-3-1", "token-idle-rank"])
def test_bf16_accumulators_with_uneven_counts_land_where_fp32_accumulators_do(mode, counts, masked):
    """A bf16 model, uneven counts (an idle rank, a micro-batch without loss tokens) under each rule: bf16
    accumulators (``accumulator_dtype: "bf16"``, ZeRO-3's gradient bytes) round every push, fp32 ones do not;
    both land within bf16's distance of the fp32 reference, far inside where a micro-batch lost would put them.
    Adam with clipping: each element moves by about the learning rate, which bf16's rounding is measured
    against (SGD's steps here are smaller than bf16's error)."""
    bf16_accumulators, fp32_accumulators = run_ranks(
        train_uneven_each, 2, [{"accumulator_dtype": "bf16"}, {}], True, mode, counts, 3, masked, *ADAM.values(),
        True)[0]
    assert bf16_accumulators["window_dtypes"] == ("torch.bfloat16", "torch.bfloat16")
    assert fp32_accumulators["window_dtypes"] == ("torch.bfloat16", "torch.float32")
    expected = reference_training(mode, counts, masked=masked, **ADAM)
    initial = {name: param.detach() for name, param in make_model().named_parameters()}
    lost = reference_training(mode, (counts[0], counts[1] - 1), masked=masked, **ADAM)  # rank 1's last one lost
    lost_off = movement_distance(lost, expected, initial)
    fp32_off = movement_distance(fp32_accumulators["params"], expected, initial)
    bf16_off = movement_distance(bf16_accumulators["params"], expected, initial)
    assert bf16_off <= 2 * fp32_off, (bf16_off, fp32_off)
    assert bf16_off <= lost_off / 4, (bf16_off, lost_off)
    # the summed gradients each step reads, bf16 accumulators against fp32 ones (the same rule and scale): Adam
    # with clipping moves parameters by the learning rate whatever a gradient's scale, so the parameters above
    # could not show a bf16 push path off by a constant factor
    assert len(bf16_accumulators["grads"]) == len(fp32_accumulators["grads"]) == 3
    for step, (bf16, fp32) in enumerate(zip(bf16_accumulators["grads"], fp32_accumulators["grads"], strict=True)):
        assert worst_rel_diff(bf16, fp32) <= BF16_ACCUMULATOR_GRAD_TOL, (step, worst_rel_diff(bf16, fp32))
