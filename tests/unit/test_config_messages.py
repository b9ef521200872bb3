"""Every refusal of the config parse says where and what to do: each ``raise`` in ds_odc/config.py,
config_options.py, config_checks.py and config_messages.py is triggered by a case below (found by reading the
source with ast, so a new raise without a case fails :func:`test_every_raise_in_the_config_modules_has_a_case`),
and each message names its field (a dotted path or key of the ds_config, or the environment variable) and an
action. In-process and fast: no ranks, no DeepSpeed engine."""
import ast
import pathlib
import re
import traceback

import pytest
from pydantic import ValidationError

from ds_odc.config import canonicalize, parse_options
from ds_odc.errors import ODCConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = [ROOT / "ds_odc" / name for name in ("config.py", "config_options.py", "config_checks.py",
                                                "config_messages.py")]
#: What a message tells the user to do.
ACTION = re.compile(r"\b(set|remove|use|leave|choose|write|give|did you mean)\b")


def odc(options=None, stage="odc", **top):
    """A ds_config: ``options`` under zero_optimization.odc, ``top`` beside it (``odc=`` is the top-level block)."""
    zero = {"stage": stage} if options is None else {"stage": stage, "odc": options}
    return {"zero_optimization": zero, **top}


#: id -> (ds_config or options, environment, the field the message must name). A dict with "zero_optimization"
#: goes through canonicalize (the whole parse), any other dict through parse_options (the options alone).
CASES = {
    # the environment switch and its options
    "switch value": (odc(stage=3), {"DS_ODC_STAGE3": "three"}, "DS_ODC_STAGE3='three'"),
    "options not JSON": (odc(stage=3), {"DS_ODC_STAGE3": "odc", "DS_ODC_OPTIONS": "{timeout_s: 1}"}, "DS_ODC_OPTIONS"),
    "options not an object": (odc(stage=3), {"DS_ODC_STAGE3": "odc", "DS_ODC_OPTIONS": "[1]"}, "DS_ODC_OPTIONS"),
    "env option misspelt": (odc(stage=3), {"DS_ODC_STAGE3": "odc", "DS_ODC_OPTIONS": '{"timeout": 1}'},
                            "DS_ODC_OPTIONS.timeout"),
    "switch asked for what odc refuses": (odc(stage=3, tensor_parallel={"autotp_size": 2}), {"DS_ODC_STAGE3": "odc"},
                                          "tensor_parallel.autotp_size"),
    # the stage value
    "misspelt stage": (odc(stage="odcc"), {}, "zero_optimization.stage"),
    "options next to another stage": (odc({}, stage=2), {}, "zero_optimization.odc"),
    "top-level block next to another stage": (odc(stage=1, odc={}), {}, "zero_optimization.stage"),
    # the blocks
    "block not a dict": (odc([1]), {}, "zero_optimization.odc"),
    "top-level block not a dict": (odc(odc="shm"), {}, "odc"),
    "blocks differ": (odc({"timeout_s": 5}, odc={"timeout_s": 7}), {}, "zero_optimization.odc.timeout_s"),
    "enabled": ({"enabled": True}, {}, "zero_optimization.odc.enabled"),
    # one option (pydantic's own checks, and ours)
    "misspelt key": ({"timeout": 3}, {}, "zero_optimization.odc.timeout"),
    "misspelt key in the top-level block": (odc(odc={"timout_s": 3}), {}, "odc.timout_s"),
    "misspelt nested key": ({"balance": {"token_cap": 8, "tokens": 5}}, {}, "zero_optimization.odc.balance.tokens"),
    "out of range": ({"timeout_s": 0}, {}, "zero_optimization.odc.timeout_s"),
    "wrong type": ({"timeout_s": "5"}, {}, "zero_optimization.odc.timeout_s"),
    "not one of the values": ({"transport": "nvlink"}, {}, "zero_optimization.odc.transport"),
    "required key missing": ({"balance": {}}, {}, "zero_optimization.odc.balance.token_cap"),
    "block not a dict of options": ({"balance": 5}, {}, "zero_optimization.odc.balance"),
    "list item out of range": ({"timeline": {"path": "t.json", "steps": [0]}}, {},
                               "zero_optimization.odc.timeline.steps[0]"),
    "shm_dir missing": ({"shm_dir": "/nonexistent/dir"}, {}, "zero_optimization.odc.shm_dir"),
    "cost of nothing": ({"balance": {"token_cap": 8, "cost_model": {"a": 0.0, "b": 0.0}}}, {},
                        "zero_optimization.odc.balance.cost_model.b"),
    "split-only option": ({"balance": {"token_cap": 8, "max_group": 4}}, {}, "zero_optimization.odc.balance.max_group"),
    # cross-field checks of the options
    "deterministic with a dtype": ({"deterministic": True, "accumulator_dtype": "fp64"}, {}, "accumulator_dtype"),
    "budget with replicate": ({"node_replica_budget_gb": 8}, {}, "node_replica_budget_gb"),
    "budget mode without a budget": ({"cross_node": "budget"}, {}, "node_replica_budget_gb"),
    "timeline without metrics": ({"metrics": False, "timeline": {"path": "t.json", "steps": [1]}}, {}, "metrics"),
    # the whole ds_config
    "unsupported ZeRO option": ({"zero_optimization": {"stage": "odc", "zero_hpz_partition_size": 2}}, {},
                                "zero_optimization.zero_hpz_partition_size"),
    "fp16": (odc(fp16={"enabled": True}), {}, "fp16.enabled"),
    "tensor_parallel not a dict": (odc(tensor_parallel=2), {}, "tensor_parallel"),
    "autotp": (odc(tensor_parallel={"autotp_size": 2}), {}, "tensor_parallel.autotp_size"),
    "sequence parallelism": (odc(sequence_parallel_size=2), {}, "sequence_parallel_size"),
    "activation offload with CPU checkpointing": (odc({"activation_offload": {"budget_mb": 1}},
                                                      activation_checkpointing={"cpu_checkpointing": True}),
                                                  {}, "activation_checkpointing.cpu_checkpointing"),
    "bf16 accumulators without bf16": (odc({"accumulator_dtype": "bf16"}), {},
                                       "zero_optimization.odc.accumulator_dtype"),
}


def _refusal(case, monkeypatch) -> BaseException:
    config, env, _ = case
    with monkeypatch.context() as patched:
        for name in ("DS_ODC_STAGE3", "DS_ODC_OPTIONS", "DS_ODC_EXPERIMENTAL_FP16"):
            patched.delenv(name, raising=False)
        for name, value in env.items():
            patched.setenv(name, value)
        with pytest.raises(ODCConfigError) as refused:
            if "zero_optimization" in config:
                canonicalize(config)
            else:
                parse_options(config)
    return refused.value


def _raise_sites() -> set:
    """(file, first line, last line) of every raise that builds a message (a bare ``raise`` re-raises one)."""
    sites = set()
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                sites.add((path.name, node.lineno, node.end_lineno))
    return sites


def _lines_run(error: BaseException) -> set:
    """(file, line) of every frame of the config modules the refusal passed through, chained errors and the
    checks pydantic ran (each check's own exception, kept in the ValidationError) included."""
    seen, pending = set(), [error]
    while pending:
        err = pending.pop()
        for frame, line in traceback.walk_tb(err.__traceback__):
            path = pathlib.Path(frame.f_code.co_filename)
            if path in MODULES:
                seen.add((path.name, line))
        pending += [e for e in (err.__context__, err.__cause__) if e is not None]
        for problem in err.errors() if isinstance(err, ValidationError) else []:
            inner = problem.get("ctx", {}).get("error")
            if isinstance(inner, BaseException):
                pending.append(inner)
    return seen


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_refusal_names_its_field_and_what_to_do(name, monkeypatch):
    message = str(_refusal(CASES[name], monkeypatch))
    field = CASES[name][2]
    assert field in message, f"{name}: {field!r} not named in: {message}"
    for line in message.splitlines():
        assert ACTION.search(line), f"{name}: no action in: {line}"
    assert "Value error, " not in message and "(got {" not in message, message  # pydantic's prefix, a block dump


def test_every_raise_in_the_config_modules_has_a_case(monkeypatch):
    run = set()
    for case in CASES.values():
        run |= _lines_run(_refusal(case, monkeypatch))
    missed = sorted(f"ds_odc/{name}:{first}" for name, first, last in _raise_sites()
                    if not any(file == name and first <= line <= last for file, line in run))
    assert not missed, f"raise sites no case triggers (add a case to CASES): {missed}"


def test_a_misspelt_key_names_the_closest_valid_keys_and_lists_them_all():
    with pytest.raises(ODCConfigError) as refused:
        parse_options({"timeout": 3, "activation_offload": {"budget_mb": 1, "prefetch": 2}, "dtype": "fp64"})
    lines = str(refused.value).splitlines()
    assert any(line.startswith("zero_optimization.odc.timeout: not an option; did you mean 'timeout_s'? (valid: "
                               "transport, timeout_s, shm_dir, ") for line in lines), lines
    assert any(line.startswith("zero_optimization.odc.dtype: not an option; did you mean 'accumulator_dtype'?")
               for line in lines), lines
    assert "zero_optimization.odc.activation_offload.prefetch: not an option; remove it (valid: budget_mb, mode)" \
        in lines


def test_a_cross_field_check_reads_as_one_sentence():
    with pytest.raises(ODCConfigError) as refused:
        parse_options({"cross_node": "budget", "timeout_s": 5})
    assert str(refused.value) == (
        "zero_optimization.odc: cross_node 'budget' needs node_replica_budget_gb (GiB per rank for the layers kept "
        "node-local): set it, or choose 'auto', 'replicate' or 'global'")


def test_a_union_reports_the_branch_that_fits_the_value():
    """``cost_model`` is a name or a formula: a dict is judged as a formula, a string as a name."""
    with pytest.raises(ODCConfigError) as refused:
        parse_options({"balance": {"token_cap": 8, "cost_model": {"a": 1.0, "c": 2}}})
    assert str(refused.value).splitlines() == [
        "zero_optimization.odc.balance.cost_model.b: Field required; set it",
        "zero_optimization.odc.balance.cost_model.c: not an option; remove it (valid: a, b, length_unit, "
        "per_micro_batch)"]
    with pytest.raises(ODCConfigError) as refused:
        parse_options({"balance": {"token_cap": 8, "cost_model": "flops"}})
    assert str(refused.value) == ("zero_optimization.odc.balance.cost_model: Input should be 'tokens' or 'measure' "
                                  "(got 'flops'); give a value that fits, or leave cost_model out (default \"tokens\")")


def test_bf16_accumulators_are_refused_at_parse_only_where_the_config_leaves_bf16_off():
    """The whole ds_config is seen at parse: bf16 off (absent, false) is refused there; on, "auto" (a framework
    fills it in) or DeepSpeed's older ``bfloat16`` name go on to initialize, which judges the model itself."""
    options = {"accumulator_dtype": "bf16"}
    for off in ({}, {"bf16": {"enabled": False}}, {"bf16": {}}):
        with pytest.raises(ODCConfigError, match="needs a bf16 model .*set bf16.enabled true"):
            canonicalize(odc(dict(options), **off))
    for on in ({"bf16": {"enabled": True}}, {"bf16": {"enabled": "auto"}}, {"bfloat16": {"enabled": True}}):
        assert canonicalize(odc(dict(options), **on)).accumulator_dtype == "bf16"
