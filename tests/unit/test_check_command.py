"""``python -m ds_odc check``, in process: the canonical form, the loss rule, refusals in initialize's words,
warnings, exit codes and the JSON object. The command run end to end as a process: distributed/test_commands.py."""
import copy
import json
from types import SimpleNamespace

import deepspeed
import pytest
import torch

import ds_odc  # noqa: F401 - registers the odc stage with deepspeed.initialize
from ds_odc.__main__ import main
from ds_odc.check import check
from ds_odc.check_rules import Machine
from ds_odc.config import canonicalize
from ds_odc.errors import ODCConfigError

EQUAL = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
         "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "zero_optimization": {"stage": "odc"}}


def config(*, odc=None, **top):
    """EQUAL with ``odc`` options under zero_optimization and ``top`` keys replaced (None removes one)."""
    made = copy.deepcopy(EQUAL)
    if odc is not None:
        made["zero_optimization"]["odc"] = odc
    for key, value in top.items():
        if value is None:
            made.pop(key, None)
        else:
            made[key] = value
    return made


def run(tmp_path, capsys, ds_config, *flags):
    """(exit code, stdout, stderr) of ``check`` on ``ds_config`` written to a file (a str: the file's text)."""
    path = tmp_path / "ds_config.json"
    path.write_text(ds_config if isinstance(ds_config, str) else json.dumps(ds_config))
    code = main(["check", str(path), "--device", "cpu", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(tmp_path, capsys, ds_config, *flags):
    code, out, _ = run(tmp_path, capsys, ds_config, "--json", *flags)
    return code, json.loads(out)


def initialize_refusal(ds_config) -> str:
    """What deepspeed.initialize raises for ``ds_config`` (its parse runs before DeepSpeed's process group)."""
    with pytest.raises(ODCConfigError) as raised:
        deepspeed.initialize(model=torch.nn.Linear(2, 2), config=copy.deepcopy(ds_config))
    return str(raised.value)


def test_an_equal_count_config_prints_the_canonical_block_and_the_mean_rule(tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, config(odc={"timeout_s": 30}))
    assert code == 0, err
    assert '3, with the top-level "odc" block below (asked for by "stage": "odc")' in out
    assert "gradient_accumulation_steps 4 (the config)" in out
    assert "\nloss rule ..." in out
    assert "mean over the global micro-batches (engine.backward(loss), managed accumulation" in out
    for key, value in {"transport": '"auto"', "timeout_s": "30.0", "cross_node": '"replicate"',
                       "loss_normalization": '"auto"', "accumulator_dtype": '"fp32"'}.items():
        assert f"odc.{key} " in out and out.split(f"odc.{key} ")[1].split("\n")[0].endswith(f" {value}"), key
    assert "warnings: none" in out


def test_the_config_given_is_left_as_it_was():
    given = config(odc={"timeout_s": 30})
    before = copy.deepcopy(given)
    assert check(given, Machine()).ok
    assert given == before


def test_uneven_counts_without_managed_accumulation_get_the_callers_rule(tmp_path, capsys):
    code, data = as_json(tmp_path, capsys, config(managed_gradient_accumulation=False, gradient_accumulation_steps=2))
    assert code == 0 and data["ok"], data
    assert data["loss_rule"].startswith("the caller's scaling, summed over micro-batches and divided by the world size "
                                        "(managed_gradient_accumulation false: each engine.step() ends the step; "
                                        "engine.backward(loss) still divides each loss by 2)")


def test_one_accumulation_step_is_the_callers_rule_too(tmp_path, capsys):
    _, data = as_json(tmp_path, capsys, config(gradient_accumulation_steps=1))
    assert "(gradient_accumulation_steps 1: every backward is a boundary" in data["loss_rule"]


def test_per_token_normalisation(tmp_path, capsys):
    code, data = as_json(tmp_path, capsys, config(odc={"loss_normalization": "token"}))
    assert code == 0 and data["odc"]["loss_normalization"] == "token"
    assert data["loss_rule"].startswith("per token: each loss is a sum over its micro-batch's loss tokens, divided at "
                                        "the step by the global token count")


def test_auto_accumulation_takes_the_flag_or_one_with_a_warning(tmp_path, capsys):
    auto = config(gradient_accumulation_steps="auto", train_micro_batch_size_per_gpu="auto")
    _, with_flag = as_json(tmp_path, capsys, auto, "--gradient-accumulation-steps", "3")
    assert "gradient_accumulation_steps 3" in with_flag["loss_rule"] and not with_flag["warnings"]
    _, without = as_json(tmp_path, capsys, auto)
    assert "gradient_accumulation_steps 1" in without["loss_rule"]
    assert without["warnings"] == ['gradient_accumulation_steps "auto": the framework fills it in; the loss rule '
                                   "takes 1 (pass --gradient-accumulation-steps N for the value it will use)"]


def test_accumulation_steps_follow_from_the_batch_sizes_as_deepspeed_derives_them(tmp_path, capsys):
    derived = config(gradient_accumulation_steps=None, train_batch_size=16, train_micro_batch_size_per_gpu=2)
    _, data = as_json(tmp_path, capsys, derived, "--ranks-per-node", "4")
    assert "gradient_accumulation_steps 2" in data["loss_rule"]


@pytest.mark.parametrize("odc, top", [
    ({"timeout_s": 0.01}, {}),
    ({"transport": "nvshmem"}, {}),
    ({"cross_node": "budget"}, {}),
    ({}, {"fp16": {"enabled": True}}),
    ({}, {"zero_optimization": {"stage": "odc", "zero_hpz_partition_size": 2}}),
])
def test_a_refused_config_exits_1_with_the_parse_and_initialize_words(tmp_path, capsys, odc, top):
    refused = config(odc=odc, **top)
    code, out, err = run(tmp_path, capsys, refused)
    with pytest.raises(ODCConfigError) as parsed:
        canonicalize(copy.deepcopy(refused))
    assert code == 1 and not out
    assert err.strip() == f"{tmp_path / 'ds_config.json'}: refused: {parsed.value}"
    _, data = as_json(tmp_path, capsys, refused)
    assert data["error"] == str(parsed.value) == initialize_refusal(refused)
    assert data["ok"] is False and data["loss_rule"] is None


def test_a_config_that_does_not_ask_for_odc_exits_1(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DS_ODC_STAGE3", raising=False)
    code, data = as_json(tmp_path, capsys, config(zero_optimization={"stage": 3}))
    assert code == 1 and data["stage"] == 3
    assert data["error"].startswith("zero_optimization.stage=3: this ds_config does not ask for the odc stage")
    monkeypatch.setenv("DS_ODC_STAGE3", "odc")
    code, out, _ = run(tmp_path, capsys, config(zero_optimization={"stage": 3}))
    assert code == 0 and "asked for by the environment switch, DS_ODC_STAGE3=odc" in out


# -- refusals initialize raises past the parse: check's words against the code initialize runs -------------------

def test_sharding_over_nodes_on_gpus_is_refused_in_open_sessions_words_and_auto_is_replicate(tmp_path, capsys):
    from ds_odc.runtime.session import SessionPlan, Shard, open_session

    two_nodes = ("--device", "cuda", "--nodes", "2", "--ranks-per-node", "2")
    code, data = as_json(tmp_path, capsys, config(odc={"cross_node": "global"}), *two_nodes)
    plan = SessionPlan(trainable=[Shard(0, 8, 2, "layer.weight")], frozen=[], compute_dtype=torch.float32,
                       device="cuda", norm_groups=1, timeout_s=1.0, cross_node="global")
    with pytest.raises(ODCConfigError) as opened:
        open_session(plan, nodes=SimpleNamespace(node_count=2, local_world=2))
    assert code == 1 and data["error"] == str(opened.value)
    # one node: nothing crosses nodes, every value is the same layout
    assert as_json(tmp_path, capsys, config(odc={"cross_node": "global"}), "--device", "cuda")[0] == 0
    # auto on GPUs: replicate, said in a warning
    code, data = as_json(tmp_path, capsys, config(odc={"cross_node": "auto", "node_replica_budget_gb": 1.0}),
                         *two_nodes)
    assert code == 0 and "cross_node 'auto' on GPUs: replicate" in " ".join(data["warnings"]), data
    # under offload_param the shards live in host memory: not the GPU refusal, but the offload's own
    offloaded = config(odc={"cross_node": "global"},
                       zero_optimization={"stage": "odc", "odc": {"cross_node": "global"},
                                          "offload_param": {"device": "cpu"}})
    code, data = as_json(tmp_path, capsys, offloaded, *two_nodes)
    assert code == 1 and data["error"].startswith("zero_optimization.offload_param is not supported"), data


def test_offloads_with_global_sharding_on_several_nodes_are_refused_in_open_sessions_words(tmp_path, capsys):
    from ds_odc.runtime.session import SessionPlan, Shard, open_session

    zero = {"stage": "odc", "odc": {"cross_node": "global"}, "offload_optimizer": {"device": "cpu"}}
    code, data = as_json(tmp_path, capsys, config(zero_optimization=zero), "--nodes", "2", "--ranks-per-node", "2")
    plan = SessionPlan(trainable=[Shard(0, 8, 2, "layer.weight")], frozen=[], compute_dtype=torch.float32,
                       device="cpu", norm_groups=1, timeout_s=1.0, cross_node="global", offloads=("offload_optimizer",))
    with pytest.raises(ODCConfigError) as opened:
        open_session(plan, nodes=SimpleNamespace(node_count=2, local_world=2))
    assert code == 1 and data["error"] == str(opened.value)
    assert as_json(tmp_path, capsys, config(zero_optimization=zero), "--nodes", "1")[0] == 0  # one node: replicate


def test_the_split_policy_with_global_sharding_is_refused_in_the_runtimes_words(tmp_path, capsys):
    from ds_odc.runtime.core import ODCRuntime

    odc = {"cross_node": "global", "balance": {"policy": "lb-mini-split", "token_cap": 4096}}
    code, data = as_json(tmp_path, capsys, config(odc=odc), "--nodes", "2", "--ranks-per-node", "2")
    runtime = SimpleNamespace(remote=object(), cross_node=SimpleNamespace(mode="global"))
    with pytest.raises(ODCConfigError) as attached:
        ODCRuntime.refuse_with_global_sharding(runtime, 'the balance policy "lb-mini-split"')
    assert code == 1 and data["error"] == str(attached.value)


@pytest.mark.parametrize("odc, top, refusal_starts", [
    ({"accumulator_dtype": "bf16"}, {"bf16": {"enabled": True}},
     "zero_optimization.odc.accumulator_dtype='bf16' on cuda"),
    ({"accumulator_dtype": "bf16"}, {}, "zero_optimization.odc.accumulator_dtype='bf16' needs a bf16 model"),
    ({"deterministic": True}, {}, "zero_optimization.odc.deterministic on cuda: exact sums have run on CPU ranks only"),
    ({"transport": "shm"}, {}, "zero_optimization.odc.transport='shm' serves cpu tensors"),
])
def test_gpu_refusals_from_the_session_plan_and_the_transport(tmp_path, capsys, odc, top, refusal_starts):
    code, data = as_json(tmp_path, capsys, config(odc=odc, **top), "--device", "cuda")
    assert code == 1 and data["error"].startswith(refusal_starts), data["error"]


def test_cuda_ipc_on_cpu_is_refused_by_the_transport(tmp_path, capsys):
    code, data = as_json(tmp_path, capsys, config(odc={"transport": "cuda_ipc"}))
    assert code == 1 and data["error"].startswith("zero_optimization.odc.transport='cuda_ipc' serves cuda tensors")


# -- warnings ------------------------------------------------------------------------------------------------------

def test_gpus_warn_that_the_path_has_never_run(tmp_path, capsys):
    code, data = as_json(tmp_path, capsys, config(odc={"activation_offload": {"budget_mb": 0}}), "--device", "cuda")
    assert code == 0 and data["ok"]
    [gpu] = data["warnings"]
    assert gpu.startswith("device cuda: on GPUs ds_odc is compiled and linked but has never run (docs/gpu.md): "
                          "the cuda_ipc transport and its CUDA push kernel, activation_offload")
    assert not as_json(tmp_path, capsys, config())[1]["warnings"]  # on CPU: none


def test_replicate_on_several_nodes_warns_of_its_memory(tmp_path, capsys):
    code, data = as_json(tmp_path, capsys, config(), "--nodes", "2", "--ranks-per-node", "4")
    assert code == 0
    assert "2 nodes: ODC across hosts has run only as two hosts simulated on one machine" in data["warnings"][0]
    assert data["warnings"][1] == (
        "cross_node 'replicate' on 2 nodes: each rank holds 2 times ZeRO-3's partitions of the parameter window and "
        "the gradient accumulator: (4 + 4)·P/4 bytes for P parameters, against (4 + 4)·P/8 sharded over the job; "
        "cross_node 'global' (sharded over the job) or 'auto' with node_replica_budget_gb bound it")


def test_global_sharding_on_several_nodes_warns_of_what_is_refused_later(tmp_path, capsys):
    _, data = as_json(tmp_path, capsys, config(odc={"cross_node": "global"}), "--nodes", "2")
    assert any(w.startswith("cross_node 'global' on several nodes: engine.offload_states() is refused at the call")
               for w in data["warnings"])
    zero = {"stage": "odc", "odc": {"cross_node": "auto", "node_replica_budget_gb": 1.0},
            "offload_param": {"device": "cpu"}}
    _, data = as_json(tmp_path, capsys, config(zero_optimization=zero), "--nodes", "2")
    assert any("zero_optimization.offload_param at initialize" in w for w in data["warnings"]), data["warnings"]


# -- usage and the JSON object ---------------------------------------------------------------------------------------

def test_a_missing_or_unreadable_file_exits_2_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere.json"
    assert main(["check", str(missing)]) == 2
    assert capsys.readouterr().err.strip() == f"python -m ds_odc check: {missing}: no such file"
    code, _, err = run(tmp_path, capsys, '{"zero_optimization": {"stage": "odc",}')
    assert code == 2 and f"{tmp_path / 'ds_config.json'}: not JSON (" in err
    code, _, err = run(tmp_path, capsys, "[1, 2]")
    assert code == 2 and "not a ds_config (a JSON object), but a list" in err
    with pytest.raises(SystemExit) as usage:
        main(["check", str(missing), "--nodes", "0"])
    assert usage.value.code == 2 and "--nodes: '0' is not a whole number >= 1" in capsys.readouterr().err


def test_the_json_object_has_its_six_keys_and_types(tmp_path, capsys):
    code, data = as_json(tmp_path, capsys, config(odc={"timeout_s": 30}), "--nodes", "2")
    assert code == 0
    assert list(data) == ["ok", "stage", "odc", "loss_rule", "warnings", "error"]
    assert data["ok"] is True and data["stage"] == 3 and data["error"] is None
    assert data["odc"]["timeout_s"] == 30.0 and set(data["odc"]) == set(ds_odc.ODCConfig.model_fields)
    assert isinstance(data["loss_rule"], str) and all(isinstance(w, str) for w in data["warnings"])
    missing = tmp_path / "nowhere.json"
    assert main(["check", str(missing), "--json"]) == 2
    usage = json.loads(capsys.readouterr().out)
    assert usage == {"ok": False, "stage": None, "odc": None, "loss_rule": None, "warnings": [],
                     "error": f"{missing}: no such file"}


def test_the_example_in_docs_check_md_is_what_the_command_prints(tmp_path, capsys, monkeypatch):
    """docs/check.md's example config and output, rerun: a change of wording shows there."""
    import os
    import re
    import shlex

    page = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "check.md")).read()
    example = json.loads(re.search(r"For this `ds_config.json`.*?```json\n(.*?)```", page, re.S).group(1))
    command, printed = re.search(r"```\n\$ python -m ds_odc (check .*?)\n(.*?)```", page, re.S).groups()
    (tmp_path / "ds_config.json").write_text(json.dumps(example))
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == printed
