"""The harness gives each rank the accelerator and backend it asks for, and never touches CUDA before a
rank does (issue 18, items 1, 5 and 8).

DeepSpeed fixes its accelerator when it is first imported. The forkserver imports it once with the CPU
accelerator, so a run that names another one must start fresh interpreters that import nothing before
the rank has set ``DS_ACCELERATOR``. On a machine without a GPU, DeepSpeed still accepts
``DS_ACCELERATOR=cuda`` (it builds its CUDA accelerator object without touching a device), which is
enough to show which accelerator a rank really got."""
import json
import os
import subprocess
import sys

import pytest

from tests.distributed.harness import PRELOAD, run_ranks, start_method

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def accelerator_seen():
    """In a rank: the accelerator DeepSpeed chose, the process group's backend, and whether torch
    considers this process a bad fork of a CUDA-initialised parent."""
    import torch
    import torch.distributed as tdist
    from deepspeed.accelerator import get_accelerator

    return {"accelerator": get_accelerator()._name, "backend": tdist.get_backend(),
            "env": os.environ.get("DS_ACCELERATOR"), "bad_fork": bool(torch.cuda._is_in_bad_fork())}


def test_a_spawned_rank_gets_the_accelerator_its_env_names():
    assert start_method({"DS_ACCELERATOR": "cuda"}, "gloo") == "spawn"
    # one rank: with two, DeepSpeed would bind the process group to cuda:<LOCAL_RANK>, which needs a GPU
    seen = run_ranks(accelerator_seen, 1, env={"DS_ACCELERATOR": "cuda"}, timeout=180)[0]
    assert seen["env"] == "cuda" and seen["accelerator"] == "cuda", seen  # not the forkserver's "cpu"
    assert seen["backend"] == "gloo"


def test_cpu_ranks_still_come_from_the_preloaded_forkserver_and_are_no_bad_forks():
    assert start_method(None, "gloo") == start_method({"DS_ACCELERATOR": "cpu"}, "gloo") == "forkserver"
    for seen in run_ranks(accelerator_seen, 2):
        assert seen == {"accelerator": "cpu", "backend": "gloo", "env": "cpu", "bad_fork": False}, seen


def test_nccl_runs_spawn_and_an_unknown_backend_is_refused_before_anything_starts():
    assert start_method(None, "nccl") == "spawn"
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"):
        run_ranks(accelerator_seen, 1, backend="mpi")


def test_a_function_that_cannot_travel_by_name_is_refused():
    def local():
        return None

    with pytest.raises(ValueError, match="module-level functions"):
        run_ranks(local, 1)


#: Imports the forkserver's preloads with every torch.cuda entry point that could initialise CUDA
#: replaced by a recorder; prints what was called, from where, and torch.cuda.is_initialized().
_PRELOAD_PROBE = r"""
import json, os, sys, traceback
import torch
import torch.cuda
calls = []
NAMES = ("init", "_lazy_init", "is_available", "device_count", "current_device", "set_device",
         "get_device_properties", "get_device_name", "get_device_capability", "synchronize", "mem_get_info",
         "is_bf16_supported", "current_stream", "default_stream")
def recorder(name, original):
    def wrapped(*args, **kwargs):
        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        calls.append(f"torch.cuda.{name} from {where}")
        return original(*args, **kwargs)
    return wrapped
for name in NAMES:
    if hasattr(torch.cuda, name):
        setattr(torch.cuda, name, recorder(name, getattr(torch.cuda, name)))
for module in json.loads(sys.argv[1]):
    __import__(module)
print("PROBE " + json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized()}))
"""


def test_the_forkserver_preloads_never_touch_cuda():
    """What the forkserver imports before it forks ranks must leave CUDA alone: a CUDA context (or even a
    driver query) in the forkserver would be inherited by every forked rank, which can then never use
    CUDA. On a GPU machine this also shows that the imports do not initialise it."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PRELOAD_PROBE, json.dumps(PRELOAD)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")][-1]
    probe = json.loads(line[len("PROBE "):])
    assert probe == {"calls": [], "initialized": False}, probe
