"""Run someone else's DeepSpeed tests on ODC without editing them: every config that reaches
``deepspeed.initialize`` with ZeRO stage 3 gets ``"stage": "odc"`` instead.

Put this directory on ``PYTHONPATH`` (``tests/compat/run_deepspeed_tests.py`` does). Python imports
``sitecustomize`` at start-up in every process, including the forkserver and pool workers that
DeepSpeed's ``DistributedTest`` starts, so the swap holds in every rank.

``DS_ODC_COMPAT_STAGE``   ``odc`` (swap) or ``3`` (leave configs alone: the ZeRO-3 baseline run).
``DS_ODC_COMPAT_TIMEOUT_S`` ``odc.timeout_s`` for swapped configs, so that a test in which one rank
                          stops early (a failed assertion) fails within a bound instead of after the
                          process-group timeout.
"""
import copy
import functools
import json
import os

STAGE = os.environ.get("DS_ODC_COMPAT_STAGE", "odc")
TIMEOUT_S = os.environ.get("DS_ODC_COMPAT_TIMEOUT_S")


def swap_stage(config):
    """A copy of ``config`` (dict or JSON path) with stage 3 replaced by "odc"; anything else unchanged."""
    if isinstance(config, (str, os.PathLike)) and os.path.exists(config):
        with open(config) as handle:
            config = json.load(handle)
    if not isinstance(config, dict):
        return config
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") not in (3, "3"):
        return config
    config = copy.deepcopy(config)
    config["zero_optimization"]["stage"] = "odc"
    if TIMEOUT_S:
        config["zero_optimization"].setdefault("odc", {}).setdefault("timeout_s", float(TIMEOUT_S))
    return config


def _install() -> None:
    import deepspeed

    initialize = deepspeed.initialize
    if getattr(initialize, "_odc_compat_swap", False):
        return

    @functools.wraps(initialize)
    def initialize_on_odc(*args, **kwargs):
        if kwargs.get("config") is not None:
            kwargs["config"] = swap_stage(kwargs["config"])
        elif kwargs.get("config_params") is not None:
            kwargs["config_params"] = swap_stage(kwargs["config_params"])
        else:
            ds_args = kwargs.get("args") or (args[0] if args else None)
            path = getattr(ds_args, "deepspeed_config", None)
            if path:
                kwargs["config"] = swap_stage(path)
                ds_args.deepspeed_config = None
        return initialize(*args, **kwargs)

    initialize_on_odc._odc_compat_swap = True
    deepspeed.initialize = initialize_on_odc


if STAGE == "odc":
    _install()
