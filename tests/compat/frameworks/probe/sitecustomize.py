"""Evidence of which engine each ``deepspeed.initialize`` built, for the compatibility runner.

A framework decides itself how and when it calls ``deepspeed.initialize`` (accelerate, TRL's
``prepare_deepspeed``, a CLI that starts its own ranks), so the scenario cannot look at the engine. This
``sitecustomize`` (on ``PYTHONPATH`` only in the runner's scenario processes, only when
``DS_ODC_COMPAT_PROBE`` names a file) wraps ``deepspeed.initialize`` once deepspeed has been imported and
appends one JSON line per engine: rank, engine class, ZeRO stage, whether it is frozen (no optimizer). The runner
fails a route whose engines are not the ones it asked for (a silent fall-back to ZeRO-3 would otherwise
look like perfect parity).

``DS_ODC_COMPAT_CPU_COMM=1`` (a CPU stand-in, both routes alike): a framework whose code cannot be edited
(a CLI that starts its own ranks) builds its model under ``zero.Init`` right after accelerate started
``torch.distributed``; on CPU ranks accelerate does not start ``deepspeed.comm`` (on GPUs it does), and
``zero.Init`` then sizes its config for one rank. This starts ``deepspeed.comm`` on the existing gloo
group first, which is what docs/frameworks.md asks CPU scripts to do by hand.
"""
import functools
import json
import os

PROBE = os.environ.get("DS_ODC_COMPAT_PROBE")
CPU_COMM = os.environ.get("DS_ODC_COMPAT_CPU_COMM") == "1"


def _start_comm_before_zero_init(deepspeed):
    from deepspeed.runtime.zero.partition_parameters import Init

    original = Init.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        import torch.distributed

        if torch.distributed.is_initialized() and not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
        original(self, *args, **kwargs)

    Init.__init__ = init


def _wrap(deepspeed):
    if CPU_COMM:
        _start_comm_before_zero_init(deepspeed)
    if not PROBE:
        return
    initialize = deepspeed.initialize
    if getattr(initialize, "_odc_compat_probe", False):
        return

    @functools.wraps(initialize)
    def probed(*args, **kwargs):
        result = initialize(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) else result
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
        row = {"rank": int(os.environ.get("RANK", "0")), "engine": type(engine).__name__, "stage": stage,
               "frozen": getattr(engine, "client_optimizer", None) is None
               and getattr(getattr(engine, "_config", None), "optimizer_name", None) is None}
        with open(PROBE, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        return result

    probed._odc_compat_probe = True
    deepspeed.initialize = probed


if PROBE or CPU_COMM:
    try:
        from ds_odc_import_hooks import when_imported
    except ImportError:  # ds_odc not installed in this venv: the runner reports the missing engines
        pass
    else:
        when_imported("deepspeed", _wrap)
