"""generate() on the odc stage runs at each rank's own pace: a rank runs exactly its own forwards, and no
collective is issued inside generate, where ZeRO-3 (transformers' synced_gpus) runs dummy forwards until the
slowest rank ends and an all-reduce per token. The tokens equal one process's greedy decoding."""
import pytest

from tests.support.generation_workloads import (
    NEW_TOKENS,
    generate_under_sequence_parallelism,
    generate_unsynced,
    rollout_then_score,
    single_process_tokens,
)
from tests.support.harness import run_ranks


@pytest.fixture(scope="module")
def expected():
    return single_process_tokens()


@pytest.mark.parametrize("kind", ["training", "frozen", "gathered"])
def test_each_rank_runs_its_own_forwards_with_no_collective(kind, expected):
    """A policy, a frozen engine, and TRL's ds3_gather_for_generation=True path (parameters gathered once)."""
    for rank, result in enumerate(run_ranks(generate_unsynced, 2, kind)):
        assert result["zero3_enabled"], "transformers must believe ZeRO-3 is on (its synced_gpus default)"
        assert result["tokens"] == expected[rank], f"rank {rank}"
        assert result["forwards"] == NEW_TOKENS[rank], f"rank {rank}: {result['forwards']} forwards"
        assert result["collectives"] == 0, f"rank {rank}"
        assert result["generate_is_the_class_s"], "engine.destroy() must give the model its class's generate back"


def test_an_explicit_synced_gpus_is_honoured(expected):
    for rank, result in enumerate(run_ranks(generate_unsynced, 2, "explicit")):
        assert result["tokens"] == expected[rank]
        assert result["forwards"] == max(NEW_TOKENS), f"rank {rank}: the lockstep runs to the longest rank"
        assert result["collectives"] >= max(NEW_TOKENS)


def test_a_zero3_model_beside_an_odc_one_keeps_transformers_lockstep(expected):
    """Only ODC-managed models change: ZeRO-3's gathers are collectives, so it must stay synced."""
    for rank, result in enumerate(run_ranks(generate_unsynced, 2, "zero3")):
        assert result["tokens"] == expected[rank]
        assert result["forwards"] == max(NEW_TOKENS), f"rank {rank}"
        assert result["collectives"] > 0


def test_a_rollout_loop_whose_ranks_stop_at_different_tokens_trains_on(expected):
    """DeepSpeed issue 8262's shape (on ZeRO-3 it needs every rank padded to max_new_tokens): no padding, a
    frozen reference scoring a different number of tokens per rank, one step per rollout."""
    for rank, rollouts in enumerate(run_ranks(rollout_then_score, 2)):
        assert rollouts[0] == expected[rank]
        assert [len(tokens) for tokens in rollouts] == [len(expected[rank])] * len(rollouts)


def test_generate_under_sequence_parallelism_is_refused_by_name():
    """ALST's attention splits the sequence over the SP group, which decoding cannot do: refused on every rank
    (the policy's and a frozen reference's), not run into wrong tokens or a hang."""
    for rank, errors in enumerate(run_ranks(generate_under_sequence_parallelism, 4)):
        for error in errors:
            assert error is not None and "sequence parallelism" in error and "synced_gpus" in error, (rank, error)
