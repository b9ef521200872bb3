"""Registration of the "odc" stage: ``deepspeed.initialize`` and ZeRO config parsing.

Two patches (one :class:`~ds_odc.integration.patching.PatchSet`), both idempotent and undone by
:func:`unregister`:

* ``deepspeed.initialize``: canonicalise an "odc" config (dict, JSON path, or ``args.deepspeed_config``;
  a stage-3 one too while ``DS_ODC_STAGE3=odc``) in place, check before DeepSpeed's first collective
  (which would hang otherwise) that every rank asked for the same odc stage (through the job's store:
  :mod:`ds_odc.comm.agreement`) and built the same model, and build an
  :class:`~ds_odc.engine.ODCEngine`, by letting the original function run while its module-global
  ``DeepSpeedEngine`` names ours;
* ``deepspeed.runtime.config.get_zero_config``: a safety net so that any other reader of a raw
  "odc" dict (``deepspeed.zero.Init(config_dict_or_path=...)``) sees stage 3 instead of a
  validation error. It works on a copy, so the caller's dict keeps its "odc" identity.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import json

import deepspeed
import deepspeed.runtime.config as ds_runtime_config

from ds_odc.comm.agreement import AgreementTimeout, answers_of_every_rank
from ds_odc.config import ENV_OPTIONS, ENV_SWITCH, ODCConfig, canonicalize, env_switch, is_odc_config
from ds_odc.errors import ODCConfigError
from ds_odc.integration.patching import PatchSet, delegating, swapped
from ds_odc.integration.surface import has
from ds_odc.integration.surface_table import LOAD_DS_CONFIG
from ds_odc.integration.timeouts import resolve_timeout_s
from ds_odc.runtime.same_model import check_same_parameters

_patches = PatchSet("deepspeed.initialize and ZeRO config parsing understand the 'odc' stage")


def _resolve_config(bound: inspect.BoundArguments):
    """Find the config ``deepspeed.initialize`` would use; return (dict or None, came_from_args)."""
    config = bound.arguments.get("config")
    if config is None:
        config = bound.arguments.get("config_params")
    args_config = getattr(bound.arguments.get("args"), "deepspeed_config", None)
    from_args = config is None and args_config is not None
    if from_args:
        config = args_config
    if config is not None and not isinstance(config, dict):
        config = load_ds_config(config)
    return config, from_args


def load_ds_config(path_or_base64: str) -> dict:
    """The ds_config a path (or base64 text) names, read as deepspeed.initialize reads it (surface_table.LOAD_DS_CONFIG:
    DeepSpeed's own reader where the release has one, else DeepSpeedConfig's way: hjson, duplicate keys refused)."""
    if has(LOAD_DS_CONFIG):
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config as deepspeeds_reader

        return deepspeeds_reader(path_or_base64)
    import base64
    import os

    import hjson
    from deepspeed.runtime.config_utils import dict_raise_error_on_duplicate_keys

    if os.path.exists(path_or_base64):
        with open(path_or_base64) as file:
            return hjson.load(file, object_pairs_hook=dict_raise_error_on_duplicate_keys)
    try:
        return hjson.loads(base64.urlsafe_b64decode(path_or_base64).decode("utf-8"))
    except (UnicodeDecodeError, AttributeError, ValueError) as err:
        raise ValueError("Expected a string path to an existing deepspeed config, or a dictionary or a valid base64. "
                         f"Received: {path_or_base64}") from err


def _without_args_config(args, active: bool):
    """``args.deepspeed_config`` hidden while the canonical dict is passed as ``config``."""
    return swapped(args, "deepspeed_config", None) if active else contextlib.nullcontext()


_initialize_calls = itertools.count()  # every rank builds its engines in the same order


def _same_request_everywhere(options: ODCConfig) -> None:
    """Every rank asked for the odc stage, with the same options and the same environment switch,
    checked through the job's store before any collective (see :mod:`ds_odc.comm.agreement`): a rank that
    differs is named at once, a rank that did not ask at all when the process group's bound runs out."""
    import torch.distributed as tdist

    world, rank, call = tdist.get_world_size(), tdist.get_rank(), next(_initialize_calls)
    if world == 1:
        return
    switch = f"{ENV_SWITCH}=odc {ENV_OPTIONS}={json.dumps(env_switch(), sort_keys=True)}" if env_switch() is not None \
        else f"{ENV_SWITCH} unset"
    asked = {key: value for key, value in options.model_dump(mode="json").items() if key != "shm_dir"}  # per node
    mine = json.dumps({"switch": switch, "options": asked}, sort_keys=True)
    timeout_s = resolve_timeout_s(options.timeout_s)
    # the process group's own store: no collective is in flight yet, so nothing else uses its connection
    store = tdist.distributed_c10d._get_default_store()
    try:
        answers = answers_of_every_rank(store, f"ds_odc/initialize/{call}", rank, world, mine, timeout_s)
    except AgreementTimeout as err:
        raise ODCConfigError(f"rank {rank} asked for the odc stage at its deepspeed.initialize #{call}, but ranks "
                             f"{err.missing} did not within {timeout_s:.0f}s (a plain stage-3 config there, or "
                             f"{ENV_SWITCH} not set on their node?): every rank must ask alike") from None
    for other, answer in enumerate(answers):
        if answer != mine:
            theirs = json.loads(answer)
            what = "environment switch" if theirs["switch"] != json.loads(mine)["switch"] else "odc options"
            raise ODCConfigError(f"rank {other} asked for the odc stage with another {what} than rank {rank}: "
                                 f"{theirs} there, {json.loads(mine)} here; every rank must ask alike")


def _same_model_everywhere(bound: inspect.BoundArguments, options: ODCConfig) -> None:
    """Before DeepSpeed's first collective (its parameter broadcast would hang on ranks with
    different models): start the process group as ``deepspeed.initialize`` would, check that every
    rank asked for the same odc stage, and compare every rank's parameter list (names, full shapes,
    trainable), naming the first difference."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    arguments = bound.signature.parameters
    dist.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=bound.arguments.get("distributed_port",
                                                               arguments["distributed_port"].default),
                          dist_init_required=bound.arguments.get("dist_init_required"))
    _same_request_everywhere(options)
    model = bound.arguments.get("model")
    if model is None:
        return
    entries = [(name, tuple(getattr(p, "ds_shape", p.shape)), bool(p.requires_grad))
               for name, p in model.named_parameters()]
    check_same_parameters(entries)


def _odc_initialize(original, *args, **kwargs):
    bound = inspect.signature(original).bind(*args, **kwargs)
    config, from_args = _resolve_config(bound)
    options = canonicalize(config)
    if options is None:
        return original(*args, **kwargs)
    from ds_odc.integration.engine import ODCEngine

    _same_model_everywhere(bound, options)
    bound.arguments["config"] = config
    bound.arguments.pop("config_params", None)
    with _without_args_config(bound.arguments.get("args"), from_args), swapped(deepspeed, "DeepSpeedEngine", ODCEngine):
        return original(*bound.args, **bound.kwargs)


def _odc_get_zero_config(original, param_dict):
    if is_odc_config(param_dict):
        param_dict = dict(param_dict)
        param_dict["zero_optimization"] = copy.copy(param_dict["zero_optimization"])
        canonicalize(param_dict)
    return original(param_dict)


def register() -> None:
    """Install both patches (idempotent)."""
    _patches.replace(deepspeed, "initialize", lambda original: delegating(_odc_initialize, original))
    _patches.replace(ds_runtime_config, "get_zero_config", lambda original: delegating(_odc_get_zero_config, original))


def unregister() -> None:
    _patches.undo()
