"""A dead or stalled peer makes the others raise an error naming it, within the configured timeout;
bad configs fail at initialize naming the field."""
import pytest

from tests.support.harness import run_ranks
from tests.support.offload_states_workloads import ends_without_destroy, leaves_training
from tests.support.workloads import bad_configs, ds_config, peer_failure


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_peer_failure_is_reported_with_the_rank(how):
    timeout_s = 4.0
    report = run_ranks(peer_failure, 2, how, timeout_s, timeout=60, report=True, wait_for=[0])
    status, outcome = report.outcomes[0]
    assert status == "ok", outcome
    assert outcome["error"] in ("ODCPeerError", "ODCTimeoutError"), outcome
    assert "rank 1" in outcome["message"] or "[1]" in outcome["message"], outcome
    assert "step fence" in outcome["message"], outcome
    if how == "killed":
        assert "exited" in outcome["message"] and outcome["waited_s"] < timeout_s, outcome
    else:
        assert timeout_s <= outcome["waited_s"] < timeout_s + 5, outcome


def test_a_slow_peer_that_keeps_pulling_is_waited_for():
    """Only a peer without progress is an error: one busy for 3x the timeout (with pulls) is not."""
    timeout_s = 2.0
    outcomes = run_ranks(peer_failure, 2, "slow", timeout_s, timeout=90)
    assert outcomes[0]["error"] is None and outcomes[1]["error"] is None, outcomes


def test_bad_configs_fail_at_initialize_naming_the_field():
    cases = [
        ("unknown_key", ds_config("odc", odc={"timout_s": 3})),
        ("bad_value", ds_config("odc", odc={"timeout_s": -1})),
        ("bad_transport", ds_config("odc", odc={"transport": "carrier-pigeon"})),
        ("offload", ds_config("odc", offload_param={"device": "nvme", "nvme_path": "/tmp"})),
        ("fp16", {**ds_config("odc"), "fp16": {"enabled": True}}),
        ("good", ds_config("odc", odc={"timeout_s": 3})),
    ]
    messages = run_ranks(bad_configs, 1, cases)[0]
    assert "zero_optimization.odc.timout_s" in messages["unknown_key"]
    assert "zero_optimization.odc.timeout_s" in messages["bad_value"]
    assert "zero_optimization.odc.transport" in messages["bad_transport"] and "shm" in messages["bad_transport"]
    assert "zero_optimization.offload_param" in messages["offload"]
    assert "fp16.enabled" in messages["fp16"]
    assert messages["good"] is None


@pytest.mark.parametrize("how,error,words,bound_s", [
    ("destroy", "ODCPeerError", "closed its engine (engine.destroy())", 2),
    ("destroy_process_group", "ODCPeerError", "left training", 2),
    ("finally", "ODCPeerError", "AssertionError: memory did not shrink", 2),
    ("idle", "ODCTimeoutError", "made no progress for 4s", 30),
])
def test_a_rank_that_leaves_training_alive_is_named_by_its_peers(tmp_path, how, error, words, bound_s):
    """Rank 0 catches an exception of its own and leaves training with its process alive (the hang DeepSpeed's
    test harness met: one rank leaves a test, the other waits at the next step's fence). engine.destroy() or a
    torn-down process group is named at once; leaving silently is bounded by odc.timeout_s (4 s here)."""
    _, waiting = run_ranks(leaves_training, 2, how, str(tmp_path / "answered"), 4.0, timeout=120)
    assert waiting["error"] == error and words in waiting["message"] and "rank 0" in waiting["message"], waiting
    assert waiting["seconds"] < bound_s, waiting


def test_a_job_that_ends_without_engine_destroy_raises_nowhere():
    assert run_ranks(ends_without_destroy, 2) == ["closed", "closed"]
