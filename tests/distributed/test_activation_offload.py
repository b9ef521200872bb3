"""Activation offload (``odc.activation_offload``) in real 2-rank ODC engines with uneven micro-batch counts:
the numbers do not change by one bit, the bytes moved are the plan's, only the planned micro-batches move
anything, parameters never, and the host pool's high-water mark is the largest single offload."""

from ds_odc.activations import SavedProfile, decide
from tests.support.activation_workloads import train_offload_variants
from tests.support.compare import assert_same_run
from tests.support.harness import run_ranks
from tests.support.workloads import bad_configs, ds_config

#: 1000 bytes: the 2- and 5-row micro-batches fit (160 saved bytes per row), the 8-row ones offload a part.
PARTIAL = {"budget_mb": 1000 / 2 ** 20}
ALL = {"budget_mb": 0}


def _assert_moves_as_planned(record, budget_mb):
    """Every micro-batch moved exactly what the policy decides for its token count (nothing when it fits),
    each storage once, never a parameter; the pool's high-water mark is the largest single offload."""
    profile = SavedProfile(*record["profile"])
    for stats in record["history"]:
        planned = decide(stats["tokens"], profile, budget_mb * 2 ** 20)
        assert (stats["planned_tensors"], stats["planned_bytes"]) == (planned.tensors, planned.offload_bytes)
        assert (stats["moved_tensors"], stats["moved_bytes"]) == (planned.tensors, planned.offload_bytes), stats
        assert stats["returned_bytes"] == stats["moved_bytes"], stats  # each offloaded storage came back once
    moved = [stats["moved_bytes"] for stats in record["history"]]
    assert record["pool"]["high_water"] == max(moved) and record["pool"]["overflow_leases"] == 0, record["pool"]
    assert record["pool"]["capacity"] == max(moved)  # the buffer holds the largest offload, not the sum


def test_offload_on_and_off_are_bit_identical_and_move_what_was_planned():
    results = run_ranks(train_offload_variants, 2, [None, PARTIAL, ALL], (1, 3))
    for rank, (off, partial, every) in enumerate(results):
        assert_same_run(off, partial, f"rank {rank}, partial offload")
        assert_same_run(off, every, f"rank {rank}, offload everything")
        _assert_moves_as_planned(partial, PARTIAL["budget_mb"])
        _assert_moves_as_planned(every, ALL["budget_mb"])
        # only the planned micro-batches: with the partial budget just the 8-row ones (rank 1's third) move
        tokens_moved = [(stats["tokens"], stats["moved_bytes"] > 0) for stats in partial["history"]]
        assert tokens_moved == [(rows, rows == 8) for rows in ((2,) if rank == 0 else (2, 5, 8))] * 3
        # parameters never: they were saved (and left alone) in every micro-batch, and everything moved scales
        # with the rows (a parameter would add a constant), 20 input + 5 x 28 hidden bytes per row
        assert all(stats["parameter_saves"] > 0 for stats in every["history"])
        assert {stats["moved_bytes"] / stats["tokens"] for stats in every["history"]} == {160.0}
        assert sum(every["profile"][0]) == 160.0 and every["profile"][1] == 0.0


def test_checkpoint_inputs_mode_moves_only_the_inputs_of_reentrant_checkpoints():
    mode = {"budget_mb": 0, "mode": "checkpoint_inputs"}
    results = run_ranks(train_offload_variants, 2, [None, mode, ALL], (2, 1), 2, True)
    for rank, (off, inputs_only, every) in enumerate(results):
        assert_same_run(off, inputs_only, f"rank {rank}, checkpoint inputs")
        assert_same_run(off, every, f"rank {rank}, every saved tensor under checkpointing")
        _assert_moves_as_planned(inputs_only, 0)
        # four checkpoints: x (5 floats per row) and three hidden states (7 each); the last layer's input stays
        assert inputs_only["profile"] == ((20.0, 28.0, 28.0, 28.0), 28.0)
        assert every["profile"] == ((20.0, 28.0, 28.0, 28.0, 28.0), 0.0)


def test_bad_activation_offload_configs_fail_at_initialize_naming_the_option():
    """At deepspeed.initialize, the way users meet them (every kind of bad value:
    tests/unit/test_activation_offload.py)."""
    def offload(block, **extra):
        return {**ds_config("odc", odc={"activation_offload": block}), **extra}

    cases = {
        "no budget": (offload({"mode": "all"}), "zero_optimization.odc.activation_offload.budget_mb: Field required"),
        "unknown mode": (offload({"budget_mb": 1, "mode": "some"}), "'all' or 'checkpoint_inputs'"),
        "DeepSpeed CPU checkpointing": (offload({"budget_mb": 1}, activation_checkpointing={"cpu_checkpointing": True}),
                                        "activation_checkpointing.cpu_checkpointing=True with "
                                        "zero_optimization.odc.activation_offload"),
    }
    good = {"offload": offload({"budget_mb": 0.5, "mode": "checkpoint_inputs"})}
    messages = run_ranks(bad_configs, 1, [(name, cfg) for name, (cfg, _) in cases.items()] + list(good.items()))[0]
    for name, (_, expected) in cases.items():
        assert messages[name] is not None and messages[name].startswith("ODCConfigError"), f"{name}: {messages[name]}"
        assert expected in messages[name], f"{name}: {messages[name]}"
    for name in good:
        assert messages[name] is None, f"{name}: {messages[name]}"
