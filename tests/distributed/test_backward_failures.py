"""A backward that raises inside autograd (docs/failures.md): one that failed before any of its gradients reached
ZeRO-3's buckets may be retried, and the step then equals the undisturbed run bit for bit; one that failed later
fails the group, every rank naming the origin at once. The fault matrix raises in ODC's own calls only (a push, a
round), never from autograd, so without these tests the guard in ``ODCEngine.backward`` never ran: a guard that
treated a late failure as retryable would let the retried micro-batch push the later layers' gradients twice,
silently; one that treated every failure as fatal would stop jobs that could go on.

The faults are tensor hooks on the target rank (:mod:`tests.support.backward_failure_workloads`), each recording
how many gradients of its backward had reached the buckets when it fired, so each test first checks that its
fault is on the side of the guard it claims."""
import pytest
import torch

from tests.support.backward_failure_workloads import backward_fault_training
from tests.support.harness import run_ranks

WORLD, TARGET = 2, 1
#: ODC's no-progress bound in these runs: far above BOUND_S, so a peer can meet the bound only by being told.
TIMEOUT_S = 30.0
#: How soon after the fault every peer has raised (measured: under 0.1 s).
BOUND_S = 5.0


@pytest.fixture(scope="module")
def undisturbed():
    return run_ranks(backward_fault_training, WORLD, None, TARGET, TIMEOUT_S, timeout=60)


def test_a_backward_that_fails_after_gradients_reached_the_buckets_fails_every_rank_naming_it():
    report = run_ranks(backward_fault_training, WORLD, "first-layer-output", TARGET, TIMEOUT_S, timeout=60,
                       report=True)
    assert not report.hung_ranks, report
    status, target = report.outcomes[TARGET]
    assert status == "ok", target
    assert target["gradients_reached"] > 0, target  # the fault is past the guard's line
    assert target["errors"][0][0] == "InjectedFault", target["errors"]
    kind, message, _ = target["errors"][1]  # the retried micro-batch: refused, nothing pushed twice
    assert kind == "ODCGroupFailedError", target["errors"]
    for rank in range(WORLD):
        status, found = report.outcomes[rank]
        assert status == "ok" and not found["completed"], (rank, found)
        kind, message, _ = found["errors"][-1]  # what the engine says when used after the failure
        assert kind == "ODCGroupFailedError", (rank, found["errors"])
        assert f"rank {TARGET} failed at backward" in message and "InjectedFault" in message, (rank, message)
    for rank in set(range(WORLD)) - {TARGET}:
        kind, message, raised_at = report.outcomes[rank][1]["errors"][0]
        assert kind in ("ODCPeerError", "ODCGroupFailedError") and f"rank {TARGET}" in message, (kind, message)
        assert "InjectedFault" in message, message
        assert raised_at - target["fired_at"] < BOUND_S, (raised_at - target["fired_at"], message)


@pytest.mark.parametrize("where", ["loss", "model-output"])
def test_a_backward_that_fails_before_any_gradient_reached_the_buckets_retries_to_the_undisturbed_result(
        undisturbed, where):
    """"model-output" fails after DeepSpeed's backward prologue ran (its hook on the model's output comes first):
    retryable all the same, by re-running the micro-batch."""
    results = run_ranks(backward_fault_training, WORLD, where, TARGET, TIMEOUT_S, timeout=60)
    target = results[TARGET]
    assert target["gradients_reached"] == 0, target  # the fault is before the guard's line
    assert [e[0] for e in target["errors"]] == ["InjectedFault"], target["errors"]
    for rank, (found, expected) in enumerate(zip(results, undisturbed)):
        assert found["completed"], (rank, found["errors"])
        assert rank == TARGET or not found["errors"], (rank, found["errors"])
        for what in ("grads", "params"):
            for name, value in expected[what].items():
                difference = (found[what][name] - value).abs().max()
                assert torch.equal(found[what][name], value), (rank, what, name, difference)
