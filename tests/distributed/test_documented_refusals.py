"""Promises the docs make about refusals and one warning, which no other test would see break (issue 47): each
is driven the way a user meets it, on 2 ranks, and the message is read for the words that tell the user what
is refused and what to do instead."""
import pytest
import torch

from tests.support.documented_refusal_workloads import (
    frozen_offload_refusals,
    generate_under_sp_with_and_without_synced_gpus,
    inexact_sum_warnings,
    initialize_a_pipeline,
    initialize_with_model_parallelism,
)
from tests.support.harness import run_ranks
from tests.support.workloads import make_model, micro_batch


def test_a_data_parallel_group_smaller_than_the_world_is_refused_by_name_on_every_rank():
    """README and docs/support.md: the data-parallel group must span every rank. An mpu of plain model
    parallelism (each rank its own data-parallel group, one model-parallel group of both) reaches the odc
    stage's own check (DeepSpeed 0.19.8 takes such an mpu for ZeRO-3 without a word) and is refused there, on
    every rank. The message names what is refused and what to pass, and must not call sequence parallelism
    unsupported: Ulysses SP runs through ALST's mpu (docs/sequence_parallel.md)."""
    for rank, result in enumerate(run_ranks(initialize_with_model_parallelism, 2, timeout=60)):
        assert result["error"] == "ODCConfigError", (rank, result)
        message = result["message"]
        assert "span every rank" in message and "holds 1 of the 2 ranks" in message, message
        assert "tensor, pipeline or other model parallelism" in message, message
        assert "Pass an mpu whose data-parallel group is every rank" in message, message
        assert "sequence parallelism through ALST's mpu is supported" in message, message



@pytest.mark.parametrize("stages, error, words", [
    (1, "AssertionError", "ZeRO-3 are incompatible with pipeline parallelism"),
    (2, "ODCConfigError", "the ranks built different models"),
])
def test_a_pipeline_fails_at_initialize_on_every_rank(stages, error, words):
    """README: pipelines fail at initialize too, though not at the data-parallel check: with one stage DeepSpeed
    asserts that ZeRO-3 and pipelines do not mix (after the engine is built); with one stage per rank each rank
    holds other layers, which the odc stage names before it looks at the groups."""
    for rank, result in enumerate(run_ranks(initialize_a_pipeline, 2, stages, timeout=60)):
        assert result["error"] == error and words in result["message"], (rank, result)

def test_a_frozen_engine_refuses_what_it_cannot_offload_naming_what_to_do():
    """docs/rl.md: a frozen engine moves the one state it has (its parameter window); anything else is refused
    by name (another state, NVMe, parameters offloaded already), each message saying what to call instead, and
    a refusal moves nothing: the engine's forward still gives the plain model's output."""
    x = micro_batch(0, 0, 0)[0]
    with torch.no_grad():
        expected = make_model()(x)
    for rank, result in enumerate(run_ranks(frozen_offload_refusals, 2, timeout=60)):
        for case in ("other_state", "nvme", "offload_param"):
            assert result[case]["error"] == "ODCConfigError", (rank, case, result[case])
        assert "only its parameters (lp_params)" in result["other_state"]["message"]
        assert "offload_states(include=[OffloadStateTypeEnum.lp_params])" in result["other_state"]["message"]
        assert "only OffloadDeviceEnum.cpu is supported" in result["nvme"]["message"]
        assert "zero_optimization.offload_param" in result["offload_param"]["message"]
        assert "leave this engine out of offload_states()" in result["offload_param"]["message"]
        for forward in ("forward_after_refusals", "offloaded_forward_after_refusal"):
            torch.testing.assert_close(result[forward], expected, rtol=1e-6, atol=1e-6)


def test_generate_under_sequence_parallelism_is_refused_unless_the_caller_passes_synced_gpus():
    """docs/rl.md: under Ulysses SP ``generate()`` is refused by name unless the caller passes ``synced_gpus``;
    then ds_odc steps aside and the call is transformers' and ALST's, which runs without the KV cache and, with
    it, fails in ALST's attention at the first decoded token (not in a refusal of ours), as the doc says. One SP
    group of 2 ranks, the tiny Llama of tests/support/sp_workloads.py."""
    for rank, result in enumerate(run_ranks(generate_under_sp_with_and_without_synced_gpus, 2, timeout=60)):
        refused = result["unsaid"]
        assert refused["error"] == "ODCConfigError", (rank, refused)
        assert "sequence parallelism" in refused["message"] and "synced_gpus" in refused["message"]
        assert result["synced_without_cache"] == {"error": None, "length": 4 + 2}, (rank, result)
        assert result["synced_with_cache"]["error"] == "AssertionError", (rank, result["synced_with_cache"])
        assert "key or value" in result["synced_with_cache"]["message"]


@pytest.mark.parametrize("loss_scale, warnings", [(1.0, 0), (1e12, 1)])
def test_deterministic_sums_beyond_their_exact_range_are_warned_about_once(loss_scale, warnings):
    """docs/normalisation.md: with ``odc.deterministic`` a value beyond the exact range is still summed, and a
    warning says so once. Over 3 steps of 2 micro-batches, every push beyond the range (loss times 1e12), each
    rank warns exactly once; gradients of an ordinary loss never warn."""
    assert run_ranks(inexact_sum_warnings, 2, loss_scale, timeout=60) == [warnings, warnings]
