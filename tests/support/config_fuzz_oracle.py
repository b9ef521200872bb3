"""The oracle of test_config_fuzz.py: what a generated ds_config must do, decided from its content alone
(valid, or invalid with the errors it may raise and the fields they must name), and the judgement of what
the ranks did with it (:func:`problems_of`). See that test's docstring
for the order of the checks, which is part of the contract."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

WORLD = 2
ZERO_KNOWN_KEYS = {"stage", "odc", "reduce_bucket_size", "stage3_param_persistence_threshold",
                   "stage3_prefetch_bucket_size", "stage3_max_live_parameters", "overlap_comm",
                   "contiguous_gradients", "offload_param", "offload_optimizer", "zero_hpz_partition_size",
                   "zero_quantized_weights", "zero_quantized_nontrainable_weights", "mics_shard_size"}


# -- the oracle --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Alternative:
    """One acceptable error: its class name, and the fields (ODC: exact dotted paths; DeepSpeed: key names
    or phrases) its message must mention, all of them."""
    error: Tuple[str, ...]
    names: Tuple[str, ...]
    exact_paths: bool = True


@dataclass(frozen=True)
class Expectation:
    alternatives: Tuple[Alternative, ...] = ()  # empty: valid

    @property
    def valid(self) -> bool:
        return not self.alternatives


def _odc(*paths: str) -> Expectation:
    return Expectation((Alternative(("ODCConfigError",), paths),))


#: DeepSpeed's own checks: (error classes DeepSpeed raises, what its message mentions).
DS_FAULT_PHRASES = {
    "batch_inconsistent": (("AssertionError",), ("train_batch_size",)),
    "batch_missing": (("AssertionError",), ("train_batch_size", "train_micro_batch_size_per_gpu")),
    "micro_zero": (("AssertionError",), ("batch size",)),  # "Train batch size: 0 has to be greater than 0"
    "lr_negative": (("ValueError",), ("learning rate",)),  # torch: "Invalid learning rate: -0.1"
    "untested_optimizer": (("AssertionError",), ("zero_allow_untested_optimizer",)),
    "scheduler_type": (("AssertionError",), ("scheduler",)),
    "mics_removed": (("DeepSpeedConfigError",), ("zero_optimization.mics_shard_size",)),
}


def _is_digit_stage(stage) -> bool:
    return isinstance(stage, int) or (isinstance(stage, str) and stage.strip().isdigit())


def _odc_option_problems(options) -> List[str]:
    """Dotted paths of every bad option (the parser reports them all at once)."""
    problems = []
    for key, value in options.items():
        path = f"zero_optimization.odc.{key}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = {
            "transport": value in ("auto", "shm", "cuda_ipc") and isinstance(value, str),
            "timeout_s": value is None or (number and 0.1 <= value <= 86400),
            "shm_dir": isinstance(value, str) and os.path.isdir(value),
            "accumulator_stripe_numel": type(value) is int and value >= 1024,
            "accumulator_dtype": isinstance(value, str) and value in ("fp32", "fp64", "bf16"),
            "loss_normalization": isinstance(value, str) and value in ("auto", "token"),
            "metrics": type(value) is bool,
            "metrics_log_interval": type(value) is int and value >= 0,
        }.get(key, False)  # an unknown key is a problem in itself
        if not ok:
            problems.append(path)
    return problems


def _zero3_unsupported(zero: dict, cfg: dict) -> Optional[Expectation]:
    """What the odc stage rejects although ZeRO-3 has it, in the order ds_odc checks it."""
    def nvme(value):
        return isinstance(value, dict) and value.get("device") == "nvme"

    in_use = (("offload_param", nvme), ("offload_optimizer", nvme),
              ("zero_hpz_partition_size", lambda v: v not in (None, 1)), ("zero_quantized_weights", bool),
              ("zero_quantized_nontrainable_weights", bool), ("mics_shard_size", lambda v: v not in (None, -1, 0)))
    for key, used in in_use:
        if key in zero and zero[key] != "auto" and used(zero[key]):
            return _odc(f"zero_optimization.{key}")
    fp16 = cfg.get("fp16", {})
    if isinstance(fp16, dict) and fp16.get("enabled") not in (False, None, "auto"):
        return _odc("fp16.enabled")
    tensor_parallel = cfg.get("tensor_parallel") or {}
    if not isinstance(tensor_parallel, dict):
        return _odc("tensor_parallel")
    if tensor_parallel.get("autotp_size", 0) > 1:
        return _odc("tensor_parallel.autotp_size")
    if cfg.get("sequence_parallel_size", 1) > 1:
        return _odc("sequence_parallel_size")
    return None


def _deepspeed_problems(cfg: dict, zero: dict, odc_options: dict) -> List[Alternative]:
    """Everything DeepSpeed itself rejects (and the transport that cannot serve CPU tensors); any of them
    may be the one reported."""
    found = []

    def add(kind: str, names=None, error=None):
        default_error, default_names = DS_FAULT_PHRASES.get(kind, (("ValidationError",), ()))
        found.append(Alternative(error or default_error, tuple(names or default_names), exact_paths=False))

    micro = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps")
    tbs = cfg.get("train_batch_size")
    if micro is None and tbs is None:
        add("batch_missing")
    elif micro == 0:
        add("micro_zero")
    elif tbs is not None:  # DeepSpeed derives what is missing by integer division, then checks the product
        if micro is None:
            micro = tbs // WORLD // (gas or 1)
        if gas is None:
            gas = tbs // micro // WORLD
        if micro * gas * WORLD != tbs:
            add("batch_inconsistent")
    for key, minimum in (("reduce_bucket_size", 1), ("stage3_param_persistence_threshold", 0),
                         ("stage3_prefetch_bucket_size", 0), ("stage3_max_live_parameters", 0)):
        if isinstance(zero.get(key), int) and zero[key] < minimum:
            add("zero_range", [key])
    for key in set(zero) - ZERO_KNOWN_KEYS:
        add("zero_unknown", [key])
    for key in ("offload_param", "offload_optimizer"):
        if key in zero and not isinstance(zero[key], dict) and zero[key] != "auto":
            add("zero_offload", [key])
    if "mics_shard_size" in zero:
        add("mics_removed")
    bf16 = cfg.get("bf16", {}).get("enabled", False)
    if bf16 not in (True, False, "auto"):
        add("bf16", ["bf16", "enabled"])
    optimizer = cfg["optimizer"]
    if optimizer["type"] not in ("Adam", "AdamW", "SGD"):
        add("optimizer_type", [optimizer["type"].lower(), "optimizer"], ("AssertionError",))
    if optimizer["params"]["lr"] < 0:
        add("lr_negative")
    if optimizer["type"] == "SGD" and not cfg.get("zero_allow_untested_optimizer"):
        add("untested_optimizer")
    if cfg.get("scheduler", {}).get("type") not in (None, "WarmupLR", "WarmupDecayLR"):
        add("scheduler_type")
    if odc_options.get("transport") == "cuda_ipc":  # checked when the windows are allocated (CPU tensors here)
        found.append(Alternative(("ODCConfigError",), ("zero_optimization.odc.transport",)))
    if odc_options.get("accumulator_dtype") == "bf16" and cfg.get("bf16", {}).get("enabled") is not True:
        # checked when the windows are planned: bf16 accumulators only under a bf16 model
        found.append(Alternative(("ODCConfigError",), ("zero_optimization.odc.accumulator_dtype",)))
    return found


def asks_for_odc(cfg: dict) -> bool:
    """``"stage": "odc"``, or the marker form (an odc block next to stage 3)."""
    zero = cfg["zero_optimization"]
    return _odc_stage(zero.get("stage")) or ("odc" in zero and zero.get("stage") in (3, "3"))


def _odc_stage(stage) -> bool:
    """The stage value "odc", in any case and with spaces around it."""
    return isinstance(stage, str) and stage.strip().lower() == "odc"


def expectation(cfg: dict) -> Expectation:
    """The oracle: what ``deepspeed.initialize(model, config=cfg)`` must do with 2 CPU ranks."""
    zero = cfg["zero_optimization"]
    stage = zero.get("stage")
    # 1. the stage value (ds_odc.config._check_stage_value)
    if isinstance(stage, str) and not _odc_stage(stage) and stage != "auto" and not _is_digit_stage(stage):
        return _odc("zero_optimization.stage")
    if "odc" in zero and not _odc_stage(stage) and stage not in (3, "3"):
        return _odc("zero_optimization.odc")
    if "odc" in cfg and not _odc_stage(stage) and stage not in (3, "3"):
        return _odc("zero_optimization.stage")
    odc_stage = asks_for_odc(cfg)
    options = zero.get("odc") if odc_stage else None
    # 2. the options, every bad one named
    if odc_stage:
        if options is not None and not isinstance(options, dict):
            return _odc("zero_optimization.odc")
        options = options or {}
        if "enabled" in options:
            return _odc("zero_optimization.odc.enabled")
        problems = _odc_option_problems(options)
        if problems:
            return _odc(*problems)
        # 3. what the odc stage does not support
        unsupported = _zero3_unsupported(zero, cfg)
        if unsupported is not None:
            return unsupported
    # 4. DeepSpeed's checks, and the transport
    return Expectation(tuple(_deepspeed_problems(cfg, zero, options or {})))


# -- judging an outcome -------------------------------------------------------------------------------
#: Error classes that mean "a bug tripped over the value", not "the value was checked".
INTERNAL_ERRORS = {"AttributeError", "KeyError", "TypeError", "IndexError", "NameError", "UnboundLocalError",
                   "ZeroDivisionError", "RecursionError", "NotImplementedError"}


def _names(message: str, name: str, exact_path: bool) -> bool:
    if exact_path:  # the dotted path as a whole word: "...odc.metrics" must not match "...odc.metrics_log_interval"
        return re.search(re.escape(name) + r"(?![\w.])", message) is not None
    return name.lower() in message.lower()


def _matches(record: dict, alternative: Alternative) -> bool:
    return record["type"] in alternative.error and all(
        _names(record["message"], name, alternative.exact_paths) for name in alternative.names)


#: Bugs found by this test and not fixed yet: name -> (predicate on the config, what the bug looks like in the
#: record of a rank). A config they cover that behaves correctly fails the test: the entry must go.
KNOWN_BUGS = {
    # Both bugs this test found are fixed: loss_normalization "token" through engine.backward(loss,
    # loss_tokens=n) (ds_odc/integration/engine_hooks.py), and an initialize that failed after the windows
    # were allocated leaving them mapped (ODCEngine.__init__ and ODCStage3Optimizer.__init__ close them).
}


def problems_of(cfg: dict, expect: Expectation, records: List[dict]) -> List[str]:
    """What is wrong with the ranks' outcomes for one config (empty: all good)."""
    problems = []
    outcomes = {(r["outcome"], r.get("type")) for r in records}
    if len(outcomes) > 1:
        problems.append(f"the ranks disagree: {[(r['outcome'], r.get('type'), r.get('message')) for r in records]}")
    for rank, record in enumerate(records):
        where = f"rank {rank}"
        if record["leftovers"]:
            problems.append(f"{where}: segments left in the private shm_dir: {record['leftovers']}")
        new = record["new_resources"]
        if record["outcome"] == "ok" or record["phase"] == "train":
            # DeepSpeed 0.19.8 keeps every engine alive after destroy() (its module-level FWD_MODULE_STACK
            # holds the model, whose hooks hold the engine): the rank's own windows stay mapped with it
            new = {**new, "mapped": [m for m in new["mapped"] if not re.search(rf"_r{rank}_(params|grads)$", m)]}
        if any(new.values()):
            problems.append(f"{where}: left behind in the rank's process: {new}")
        if "destroy_error" in record:
            problems.append(f"{where}: engine.destroy() raised {record['destroy_error']['traceback']}")
        if expect.valid:
            if record["outcome"] != "ok":
                problems.append(f"{where}: a valid config failed in {record['phase']}:\n{record['traceback']}")
                continue
            wanted_engine = "ODCEngine" if asks_for_odc(cfg) else "DeepSpeedEngine"
            bf16 = cfg.get("bf16", {}).get("enabled") is True
            if (record["engine"], record["global_steps"], record["losses_finite"], record["dtype"]) != (
                    wanted_engine, 1, True, "torch.bfloat16" if bf16 else "torch.float32"):
                problems.append(f"{where}: trained, but wrongly: {record}")
            continue
        if record["outcome"] == "ok":
            problems.append(f"{where}: initialize accepted an invalid config; expected {expect.alternatives}")
            continue
        summary = f"{record['type']}: {record['message']}"
        if record["phase"] != "initialize":
            problems.append(f"{where}: failed in {record['phase']}, not at initialize: {summary}")
        if record["type"] in INTERNAL_ERRORS or (record["type"] != "ODCConfigError"
                                                 and record["frames"][-1][0].startswith("ds_odc/")):
            problems.append(f"{where}: internal error instead of a config error:\n{record['traceback']}")
        elif not any(_matches(record, alternative) for alternative in expect.alternatives):
            problems.append(f"{where}: {summary}\n  does not match any of {expect.alternatives}")
    return problems
