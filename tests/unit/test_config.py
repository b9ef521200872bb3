import copy

import pytest

from ds_odc.config import ENV_EXPERIMENTAL_FP16, ODCConfig, canonicalize, is_odc_config, parse_options
from ds_odc.errors import ODCConfigError


def test_canonicalize_rewrites_in_place_and_is_idempotent():
    cfg = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 7}, "reduce_bucket_size": 10}}
    options = canonicalize(cfg)
    assert options == ODCConfig(timeout_s=7)
    assert cfg["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 10}
    assert cfg["odc"]["timeout_s"] == 7.0
    again = copy.deepcopy(cfg)
    assert canonicalize(again) == options and again == cfg


def test_other_stages_are_left_alone():
    for cfg in ({"zero_optimization": {"stage": 3}}, {"zero_optimization": {"stage": 2}}, {},
                {"zero_optimization": True}):
        before = copy.deepcopy(cfg)
        assert canonicalize(cfg) is None and cfg == before and not is_odc_config(cfg)


@pytest.mark.parametrize("options,field", [
    ({"timeout": 3}, "zero_optimization.odc.timeout"),
    ({"timeout_s": 0}, "zero_optimization.odc.timeout_s"),
    ({"transport": "nvlink"}, "zero_optimization.odc.transport"),
    ({"loss_normalization": "sample"}, "zero_optimization.odc.loss_normalization"),
    ({"accumulator_stripe_numel": 8}, "zero_optimization.odc.accumulator_stripe_numel"),
    ({"shm_dir": "/nonexistent/dir"}, "zero_optimization.odc.shm_dir"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ODCConfigError, match=field.replace(".", r"\.")):
        parse_options(options)


@pytest.mark.parametrize("zero,field", [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}, "zero_optimization.offload_optimizer"),
    ({"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "zero_optimization.offload_param"),
    ({"zero_hpz_partition_size": 2}, "zero_optimization.zero_hpz_partition_size"),
    ({"mics_shard_size": 2}, "zero_optimization.mics_shard_size"),
])
def test_unsupported_zero_features_are_rejected(zero, field):
    with pytest.raises(ODCConfigError, match=field):
        canonicalize({"zero_optimization": {"stage": "odc", **zero}})


@pytest.mark.parametrize("device", ["none", "cpu"])
def test_parameter_offload_to_the_host_is_fine(device):
    assert canonicalize({"zero_optimization": {"stage": "odc", "offload_param": {"device": device}}}) is not None


def test_balance_block_parses_each_cost_model():
    tokens = parse_options({"balance": {"token_cap": 4096}}).balance
    assert (tokens.policy, tokens.cost_model, tokens.padding) == ("lb-mini", "tokens", "auto")
    fitted = parse_options({"balance": {"token_cap": 4096, "policy": "lb-micro",
                                        "cost_model": {"a": 1.98, "b": 2.61, "length_unit": 32000}}}).balance
    assert fitted.cost_model.a == 1.98 and fitted.cost_model.length_unit == 32000
    assert parse_options({"balance": {"token_cap": 8, "cost_model": "measure"}}).balance.cost_model == "measure"


@pytest.mark.parametrize("balance, field", [
    ({}, "balance.token_cap"),
    ({"token_cap": 0}, "balance.token_cap"),
    ({"token_cap": 64, "policy": "local-sort"}, "balance.policy"),
    ({"token_cap": 64, "cost_model": "flops"}, "balance.cost_model"),
    ({"token_cap": 64, "cost_model": {"a": 0.0, "b": 0.0}}, "balance.cost_model"),
    ({"token_cap": 64, "cost_model": {"a": 1.0}}, "balance.cost_model"),
    ({"token_cap": 64, "padding": "left"}, "balance.padding"),
    ({"token_cap": 64, "tokens": 5}, "balance.tokens"),
])
def test_bad_balance_options_name_the_field(balance, field):
    with pytest.raises(ODCConfigError, match=f"zero_optimization.odc.{field}"):
        parse_options({"balance": balance})


def test_cross_node_defaults_to_replicate_without_a_budget():
    options = parse_options({})
    assert (options.cross_node, options.node_replica_budget_gb) == ("replicate", None)
    cfg = {"zero_optimization": {"stage": "odc", "odc": {}}}
    canonicalize(cfg)
    assert "cross_node" not in cfg["odc"] and "node_replica_budget_gb" not in cfg["odc"]  # defaults left out


@pytest.mark.parametrize("options", [
    {"cross_node": "replicate"}, {"cross_node": "global"}, {"cross_node": "auto"},
    {"cross_node": "auto", "node_replica_budget_gb": 8.0}, {"cross_node": "auto", "node_replica_budget_gb": 2},
    {"cross_node": "auto", "node_replica_budget_gb": 0.5}, {"cross_node": "budget", "node_replica_budget_gb": 8},
])
def test_cross_node_accepts_each_mode_and_a_budget_with_auto_or_budget(options):
    parsed = parse_options(options)
    assert parsed.cross_node == options["cross_node"]
    assert parsed.node_replica_budget_gb == options.get("node_replica_budget_gb")
    cfg = {"zero_optimization": {"stage": "odc", "odc": dict(options)}}
    canonicalize(cfg)
    assert cfg["odc"] == {k: v for k, v in options.items() if v != "replicate"}  # the canonical block carries them


@pytest.mark.parametrize("mode", ["replicate", "global"])
def test_a_budget_with_replicate_or_global_is_refused_naming_both_fields(mode):
    with pytest.raises(ODCConfigError) as refused:
        parse_options({"cross_node": mode, "node_replica_budget_gb": 8})
    message = str(refused.value)
    assert "node_replica_budget_gb" in message and f"cross_node 'budget' and 'auto', not {mode!r}" in message, message
    with pytest.raises(ODCConfigError, match="node_replica_budget_gb"):  # the default mode too
        parse_options({"node_replica_budget_gb": 8})


def test_budget_without_its_budget_is_refused_naming_the_field():
    with pytest.raises(ODCConfigError, match="cross_node 'budget' needs node_replica_budget_gb"):
        parse_options({"cross_node": "budget"})


@pytest.mark.parametrize("options, field", [
    ({"cross_node": "hybrid"}, "cross_node"),
    ({"cross_node": "Global"}, "cross_node"),
    ({"cross_node": None}, "cross_node"),
    ({"cross_node": "auto", "node_replica_budget_gb": 0}, "node_replica_budget_gb"),
    ({"cross_node": "auto", "node_replica_budget_gb": -1.0}, "node_replica_budget_gb"),
    ({"cross_node": "auto", "node_replica_budget_gb": "8"}, "node_replica_budget_gb"),
    ({"cross_node": "auto", "node_replica_budget_gb": True}, "node_replica_budget_gb"),
])
def test_bad_cross_node_values_name_the_field(options, field):
    with pytest.raises(ODCConfigError, match=rf"zero_optimization\.odc\.{field}"):
        parse_options(options)


def test_the_marker_form_asks_for_odc_and_every_stage_check_keeps_seeing_3():
    """``"stage": 3`` plus an odc block under ``zero_optimization`` (for frameworks that compare the stage
    with 3 themselves): the canonical form, the stage never leaving 3, balance included."""
    config = {"zero_optimization": {"stage": 3, "odc": {"timeout_s": 9, "balance": {"token_cap": 64}}}}
    assert is_odc_config(config)
    options = canonicalize(config)
    assert options.timeout_s == 9.0 and options.balance.token_cap == 64
    assert config["zero_optimization"] == {"stage": 3} and config["odc"]["timeout_s"] == 9.0
    assert canonicalize(config) == options  # idempotent


@pytest.mark.parametrize("stage", [0, 1, 2, "2"])
def test_odc_options_next_to_another_stage_are_refused_naming_the_field(stage):
    with pytest.raises(ODCConfigError, match=r"zero_optimization\.odc is set but zero_optimization\.stage="):
        canonicalize({"zero_optimization": {"stage": stage, "odc": {"balance": {"token_cap": 64}}}})


def test_the_environment_switch_makes_a_stage_3_config_ask_for_odc(monkeypatch):
    monkeypatch.setenv("DS_ODC_STAGE3", "odc")
    monkeypatch.setenv("DS_ODC_OPTIONS", '{"timeout_s": 11}')
    config = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 10}}
    assert not is_odc_config(config)  # the dict alone does not ask
    assert canonicalize(config).timeout_s == 11.0
    assert config["zero_optimization"]["stage"] == 3 and config["odc"] == {"timeout_s": 11.0}
    for other in ({"zero_optimization": {"stage": 2}}, {"train_batch_size": 4}):  # only stage-3 configs
        assert canonicalize(other) is None and "odc" not in other


@pytest.mark.parametrize("value,options,match", [
    ("ODC3", None, "DS_ODC_STAGE3='ODC3'"),
    ("odc", "{timeout_s: 1}", "DS_ODC_OPTIONS=.* is not JSON"),
    ("odc", "[1]", "DS_ODC_OPTIONS=.*JSON object"),
    ("odc", '{"timeout": 1}', r"DS_ODC_OPTIONS\.timeout: not an option; did you mean 'timeout_s'"),
])
def test_a_bad_environment_switch_is_refused_naming_the_variable(monkeypatch, value, options, match):
    monkeypatch.setenv("DS_ODC_STAGE3", value)
    if options is not None:
        monkeypatch.setenv("DS_ODC_OPTIONS", options)
    with pytest.raises(ODCConfigError, match=match):
        canonicalize({"zero_optimization": {"stage": 3}})


def test_what_the_switch_asks_for_and_odc_cannot_honour_is_refused_saying_the_variable_asked(monkeypatch):
    monkeypatch.setenv("DS_ODC_STAGE3", "odc")
    with pytest.raises(ODCConfigError, match=r"zero_hpz_partition_size.*DS_ODC_STAGE3=odc asked for the odc stage"):
        canonicalize({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})


@pytest.mark.parametrize("value", ["", "0", "off", "no", "false"])
def test_the_switch_off_leaves_stage_3_alone(monkeypatch, value):
    monkeypatch.setenv("DS_ODC_STAGE3", value)
    assert canonicalize({"zero_optimization": {"stage": 3}}) is None


# -- "does this config ask for odc": one function (ds_odc_import_hooks.asks_for_odc) for the autoload's guard,
# which must not import ds_odc, and for ds_odc's accelerate patch, held here to what canonicalize does ----------
ASKING_CONFIGS = [
    {"zero_optimization": {"stage": "odc"}},
    {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5}}},
    {"zero_optimization": {"stage": "ODC"}},
    {"zero_optimization": {"stage": " Odc "}, "odc": {"timeout_s": 5}},
    {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5}}, "odc": {"timeout_s": 6}},  # refused: differ
    {"zero_optimization": {"stage": 3, "odc": {}}},
    {"zero_optimization": {"stage": "3", "odc": {"timeout_s": 5}}},
    {"zero_optimization": {"stage": 3}, "odc": {"timeout_s": 5.0}},  # the canonical form
    {"zero_optimization": {"stage": 3}},
    {"zero_optimization": {"stage": "3"}},
    {"zero_optimization": {"stage": 2}},
    {"zero_optimization": {"stage": 0}},
    {"zero_optimization": {"stage": "auto"}},
    {"zero_optimization": {"stage": 1, "odc": {}}},  # odc options next to another stage: refused by name
    {"zero_optimization": True},
    {},
    None,
    "ds_config.json",
]


@pytest.mark.parametrize("switch", [None, "", "0", "off", "odc", " ODC ", "three"])
@pytest.mark.parametrize("config", ASKING_CONFIGS)
def test_the_autoload_and_the_accelerate_patch_ask_what_canonicalize_answers(config, switch, monkeypatch):
    import ds_odc_autoload
    import ds_odc_import_hooks
    from ds_odc.integration import hf

    assert ds_odc_autoload.asks_for_odc is hf.asks_for_odc is ds_odc_import_hooks.asks_for_odc
    if switch is None:
        monkeypatch.delenv("DS_ODC_STAGE3", raising=False)
    else:
        monkeypatch.setenv("DS_ODC_STAGE3", switch)
    asked = ds_odc_import_hooks.asks_for_odc(copy.deepcopy(config))
    try:
        answer = canonicalize(copy.deepcopy(config))
    except ODCConfigError:
        assert asked, "a config ds_odc refuses for its odc options or switch must reach ds_odc, which names why"
    else:
        assert asked == (answer is not None)


def test_fp16_is_refused_unless_the_experimental_switch_lets_it_through(monkeypatch):
    config = {"zero_optimization": {"stage": "odc"}, "fp16": {"enabled": True}}
    monkeypatch.delenv(ENV_EXPERIMENTAL_FP16, raising=False)
    with pytest.raises(ODCConfigError, match="fp16.enabled=True"):
        canonicalize(copy.deepcopy(config))
    monkeypatch.setenv(ENV_EXPERIMENTAL_FP16, "yes")  # only "1" lets it through
    with pytest.raises(ODCConfigError, match="fp16.enabled=True"):
        canonicalize(copy.deepcopy(config))
    monkeypatch.setenv(ENV_EXPERIMENTAL_FP16, "1")  # the GPU kit's fp16 item
    assert canonicalize(copy.deepcopy(config)) is not None


def test_bf16_accumulators_are_taken_only_where_they_hold_zero3s_bytes():
    """accumulator_dtype "bf16": a bf16 model on CPU ranks gets bf16 accumulators; another model dtype, a GPU
    and deterministic sums (their own fp64 regions) are refused by name."""
    import torch

    from ds_odc.integration.zero3_windows import accumulator_dtype

    bf16 = parse_options({"accumulator_dtype": "bf16"})
    assert accumulator_dtype(bf16, torch.bfloat16, "cpu") is torch.bfloat16
    assert accumulator_dtype(parse_options({}), torch.bfloat16, "cpu") is torch.float32
    with pytest.raises(ODCConfigError, match="accumulator_dtype='bf16' needs a bf16 model.*torch.float32"):
        accumulator_dtype(bf16, torch.float32, "cpu")
    with pytest.raises(ODCConfigError, match="accumulator_dtype='bf16' on cuda:0"):
        accumulator_dtype(bf16, torch.bfloat16, "cuda:0")
    with pytest.raises(ODCConfigError, match="leave accumulator_dtype='bf16' out"):
        parse_options({"accumulator_dtype": "bf16", "deterministic": True})


# -- no option is dropped: zero_optimization.odc and the top-level odc block, read by one function ------------
def _trainer_with(config):
    """The parts of a Trainer that ``hf_trainer.odc_options`` reads."""
    from types import SimpleNamespace

    return SimpleNamespace(is_deepspeed_enabled=True, args=SimpleNamespace(hf_deepspeed_config=SimpleNamespace(
        config=config)))


@pytest.mark.parametrize("stage", ["odc", 3])
def test_a_top_level_odc_block_next_to_the_stage_keeps_its_options(stage):
    """Both blocks are read and merged, with the stage value and with the marker form (stage 3): an option
    written in either survives canonicalize, and the Trainer's own reading of the config sees the same."""
    from ds_odc.integration.hf_trainer import odc_options

    blocks = {"zero_optimization": {"stage": stage, "odc": {"metrics": False}}, "odc": {"timeout_s": 5}}
    written = [blocks, {"zero_optimization": {"stage": "odc"}, "odc": {"timeout_s": 5, "metrics": False}}]
    for config in written:
        assert odc_options(_trainer_with(copy.deepcopy(config))) == ODCConfig(timeout_s=5, metrics=False)
        options = canonicalize(config)
        assert options == ODCConfig(timeout_s=5, metrics=False), options
        assert config["zero_optimization"] == {"stage": 3} and config["odc"] == {"timeout_s": 5.0, "metrics": False}
        assert canonicalize(config) == options  # idempotent
        assert odc_options(_trainer_with(config)) == options


def test_the_marker_form_is_read_by_the_trainer_as_canonicalize_reads_it():
    from ds_odc.integration.hf_trainer import odc_options

    marker = {"zero_optimization": {"stage": 3, "odc": {"timeout_s": 9}}}
    assert odc_options(_trainer_with(copy.deepcopy(marker))) == canonicalize(marker) == ODCConfig(timeout_s=9)


def test_blocks_that_agree_are_merged_and_a_saved_canonical_config_keeps_its_options():
    """Same value for each key both blocks give (5 and 5.0; a nested block with and without its defaults):
    merged. A canonical config saved and copied back with ``"stage": "odc"`` keeps every option."""
    config = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5, "balance": {"token_cap": 64,
                                                                                        "policy": "lb-mini"}}},
              "odc": {"timeout_s": 5.0, "balance": {"token_cap": 64}, "accumulator_dtype": "fp64"}}
    options = canonicalize(config)
    assert (options.timeout_s, options.balance.token_cap, options.accumulator_dtype) == (5.0, 64, "fp64")
    saved = copy.deepcopy(config)
    saved["zero_optimization"]["stage"] = "odc"
    assert canonicalize(saved) == options and saved == config


def test_blocks_that_differ_are_refused_naming_both_paths_and_both_values():
    config = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5, "metrics": False, "transport": "shm"}},
              "odc": {"timeout_s": 7, "metrics": False, "transport": "auto"}}
    with pytest.raises(ODCConfigError) as refused:
        canonicalize(config)
    message = str(refused.value)
    for part in ("zero_optimization.odc.timeout_s=5", "odc.timeout_s=7", "zero_optimization.odc.transport='shm'",
                 "odc.transport='auto'"):
        assert part in message, message
    assert "metrics" not in message, message


# -- the stage value: "odc" in any case, blanks around it ignored, in the config as in the environment --------
@pytest.mark.parametrize("form,env", [
    ({"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5}}}, {}),
    ({"zero_optimization": {"stage": "ODC", "odc": {"timeout_s": 5}}}, {}),
    ({"zero_optimization": {"stage": " Odc "}, "odc": {"timeout_s": 5}}, {}),
    ({"zero_optimization": {"stage": 3}}, {"DS_ODC_STAGE3": "ODC", "DS_ODC_OPTIONS": '{"timeout_s": 5}'}),
    ({"zero_optimization": {"stage": 3}}, {"DS_ODC_STAGE3": "odc", "DS_ODC_OPTIONS": '{"timeout_s": 5}'}),
    ({"zero_optimization": {"stage": "3", "odc": {"timeout_s": 5}}}, {}),  # the marker form
    ({"zero_optimization": {"stage": 3}, "odc": {"timeout_s": 5.0}}, {}),  # the canonical form
], ids=["odc", "ODC", "blank-Odc", "env-ODC", "env-odc", "marker", "canonical"])
def test_every_spelling_of_the_stage_asks_for_odc_alike(form, env, monkeypatch):
    import ds_odc_import_hooks

    monkeypatch.delenv("DS_ODC_STAGE3", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert ds_odc_import_hooks.asks_for_odc(form)
    assert is_odc_config(form) == (not env)
    assert canonicalize(form) == ODCConfig(timeout_s=5)
    assert form["zero_optimization"]["stage"] in (3, "3") and form["odc"] == {"timeout_s": 5.0}


@pytest.mark.parametrize("value, odc", [("odc", True), ("ODC", True), (" Odc ", True), ("odc3", False), ("", False),
                                        (3, False), (None, False)])
def test_one_predicate_reads_the_stage_and_the_accelerate_variable(value, odc):
    from ds_odc_import_hooks import is_odc_stage, translate_accelerate_stage

    assert is_odc_stage(value) is odc
    if isinstance(value, str):
        environ = {"ACCELERATE_DEEPSPEED_ZERO_STAGE": value}
        translate_accelerate_stage(environ)
        assert environ == ({"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", "DS_ODC_STAGE3": "odc"} if odc else
                           {"ACCELERATE_DEEPSPEED_ZERO_STAGE": value})


def test_ds_odc_options_are_merged_into_a_config_that_asks_for_odc_itself(monkeypatch):
    """``DS_ODC_OPTIONS`` next to a config that asks for the odc stage by itself is a third source of options, not
    one dropped without a word: merged where it agrees with the config's blocks, refused naming both where not."""
    monkeypatch.setenv("DS_ODC_OPTIONS", '{"metrics": false, "timeout_s": 5}')
    config = {"zero_optimization": {"stage": "odc", "odc": {"timeout_s": 5.0}}}
    assert canonicalize(config) == ODCConfig(timeout_s=5, metrics=False)
    assert config["odc"] == {"timeout_s": 5.0, "metrics": False}
    monkeypatch.setenv("DS_ODC_OPTIONS", '{"timeout_s": 9}')
    with pytest.raises(ODCConfigError, match=r"zero_optimization\.odc\.timeout_s=5\.0 and DS_ODC_OPTIONS\.timeout_s=9"):
        canonicalize({"zero_optimization": {"stage": 3, "odc": {"timeout_s": 5.0}}})
    monkeypatch.delenv("DS_ODC_OPTIONS")
    assert canonicalize({"zero_optimization": {"stage": 3}}) is None  # a plain stage-3 config: left alone
