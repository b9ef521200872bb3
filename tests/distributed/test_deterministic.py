"""Bit for bit on request: with ``odc.deterministic`` (or ``torch.use_deterministic_algorithms(True)``) two runs
of one job give identical losses, summed gradients and parameters at every step, although ranks run uneven
micro-batch counts (zero included) and start each step in reversed orders in the two runs, so that pushes reach
their owners in other orders. Exact sums are still the step one process takes (docs/normalisation.md)."""
import pytest

from tests.support import deterministic_workloads as deterministic
from tests.support.compare import assert_same_run, same_bits, worst_rel_diff
from tests.support.harness import run_ranks
from tests.support.workloads import reference_training

COUNTS = (3, 1, 0, 2)
MASKED = ((0, 1),)  # a micro-batch without a loss token
FP32_TOL = 1e-5


def test_without_exact_sums_the_same_two_runs_differ():
    """The control: the reversed start order sends pushes in another order, so fp32 accumulators (the default) sum
    them in another order in the second run, and each step's summed gradients differ in some bits; without it the
    test below could not fail. The gradients, not the parameters, are compared: an update far below a parameter's
    last bit leaves it unchanged, and the parameters alone once hid every difference."""
    first, second = run_ranks(deterministic.train_twice, 4, COUNTS, 3, "fp32", MASKED, timeout=240)[0]
    assert not first["exact"]
    same = [step for step, (a, b) in enumerate(zip(first["grads"], second["grads"], strict=True)) if same_bits(a, b)]
    assert not same, f"two fp32 runs summed pushes in other orders and got the same gradient bits at steps {same}"


@pytest.mark.parametrize("via", ["config", "torch"])
def test_two_runs_with_ranks_delayed_differently_are_identical_bit_for_bit(via):
    runs = run_ranks(deterministic.train_twice, 4, COUNTS, 3, via, MASKED, timeout=240)
    expected = reference_training("token", COUNTS, masked=MASKED)
    for rank, (first, second) in enumerate(runs):
        assert first["exact"] and second["exact"], rank
        assert_same_run(first, second, f"{via}, rank {rank}")
        assert worst_rel_diff(second["params"][-1], expected) <= FP32_TOL, rank
