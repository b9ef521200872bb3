"""A slice of the protocol, contract and parity tests under schedule perturbation (``DS_ODC_PERTURB``: a short
random delay at every protocol point of ``ds_odc.comm.schedule``, drawn from the seed and the rank), a few seeds
each. A failure names its seed; rerun it with the same value, then pin the order it found with a forced-order test
(tests/distributed/test_interleavings.py). The whole contract and parity suite under perturbation and CPU
contention is opt-in: ``python tests/compat/run_perturbed.py`` (tests/README.md)."""
import pytest

from tests.support import contract_workloads as contracts
from tests.support import interleaving_workloads as interleavings
from tests.support.compare import assert_close_nested, worst_rel_diff
from tests.support.harness import run_ranks
from tests.support.workloads import reference_training

SEEDS = (11, 12, 13)
TOL = 1e-6  # test_uneven.py's bar


def _perturbed(seed: int) -> dict:
    return {"DS_ODC_PERTURB": str(seed)}


@pytest.mark.parametrize("seed", SEEDS)
def test_uneven_counts_under_perturbation_equal_one_process(seed):
    """Ranks at 3 and 1 micro-batches (SGD, no clipping: a wrong divisor or a lost push shows) with every pull,
    push, round, fence and publish delayed at random."""
    results = run_ranks(interleavings.uneven_under_perturbation, 2, (3, 1), env=_perturbed(seed))
    expected = reference_training("unmanaged", (3, 1))
    for rank, result in enumerate(results):
        installed_seed, delays = result["perturbation"]
        assert installed_seed == seed and delays > 20, result["perturbation"]  # it really ran perturbed
        diff = worst_rel_diff(result["params"], expected)
        assert diff <= TOL, f"DS_ODC_PERTURB={seed}, rank {rank}: {diff:.2e} from one process"


@pytest.fixture(scope="module")
def zero3_reads():
    return run_ranks(contracts.gradient_reads_before_step, 2, 3, (2, 2))


@pytest.mark.parametrize("seed", SEEDS)
def test_gradient_reads_under_perturbation_equal_zero3(zero3_reads, seed):
    odc = run_ranks(contracts.gradient_reads_before_step, 2, "odc", (2, 2), env=_perturbed(seed))
    for rank in range(2):
        assert_close_nested(odc[rank], zero3_reads[rank], rtol=1e-5, atol=1e-6, path=f"DS_ODC_PERTURB={seed}")


@pytest.mark.parametrize("seed", SEEDS)
def test_reads_and_writes_between_backward_and_step_under_perturbation_equal_zero3(tmp_path, seed):
    """The interleavings' scenarios unforced, with the order left to the perturbation."""
    calls = ("get_fp32_grad_partitions", "safe_set_full_grad", "zero_grad")
    signals = tmp_path / "signals"
    signals.mkdir()
    zero3 = run_ranks(interleavings.interleavings, 2, 3, calls, False, str(signals), str(tmp_path / "z"))
    odc = run_ranks(interleavings.interleavings, 2, "odc", calls, False, str(signals), str(tmp_path / "o"),
                    env=_perturbed(seed))
    for rank in range(2):
        for call in calls:
            assert_close_nested(odc[rank][call]["params"], zero3[rank][call]["params"], rtol=1e-5, atol=1e-6,
                                path=f"DS_ODC_PERTURB={seed} {call}")
