"""A dead or stalled peer makes the others raise an error naming it, within the configured timeout;
bad configs fail at initialize naming the field."""
import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.workloads import bad_configs, ds_config, peer_failure


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
