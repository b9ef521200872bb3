"""The harness gives each rank the accelerator and backend it asks for, and never touches CUDA before a
rank does (what a GPU run of the suite needs).

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

from tests.support.harness import PRELOAD, run_ranks, start_method

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


def driverless_cuda_build() -> bool:
    """A CUDA build of torch on a machine without the NVIDIA driver: NVML cannot answer, so torch's
    availability check falls back to ``cudaGetDeviceCount``, which marks forks bad whatever the preloads
    do. Nothing can use CUDA on such a machine, so there a bad fork cannot matter (and is not asserted)."""
    import torch

    return torch.version.cuda is not None and torch.cuda._device_count_nvml() < 0


def test_cpu_ranks_still_come_from_the_preloaded_forkserver_and_are_no_bad_forks():
    assert start_method(None, "gloo") == start_method({"DS_ACCELERATOR": "cpu"}, "gloo") == "forkserver"
    for seen in run_ranks(accelerator_seen, 2):
        assert seen["accelerator"] == "cpu" and seen["backend"] == "gloo" and seen["env"] == "cpu", seen
        assert not seen["bad_fork"] or driverless_cuda_build(), seen


def test_nccl_runs_spawn_and_an_unknown_backend_is_refused_before_anything_starts():
    assert start_method(None, "nccl") == "spawn"
    with pytest.raises(ValueError, match=r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"):
        run_ranks(accelerator_seen, 1, backend="mpi")


def test_a_function_that_cannot_travel_by_name_is_refused():
    def local():
        return None

    with pytest.raises(ValueError, match="module-level functions"):
        run_ranks(local, 1)


#: Imports the forkserver's preloads, in order, with every torch.cuda entry point that could initialise the
#: CUDA driver replaced by a recorder that notes whether the call was harmless (torch answers availability
#: from NVML under PYTORCH_NVML_BASED_CUDA_CHECK=1); then forks, as the forkserver does, and asks the child
#: whether torch considers it a bad fork. Prints the findings.
_PRELOAD_PROBE = r"""
import json, os, sys, traceback
import torch
import torch.cuda
calls = []
NAMES = ("init", "_lazy_init", "is_available", "device_count", "current_device", "set_device",
         "get_device_properties", "get_device_name", "get_device_capability", "synchronize", "mem_get_info",
         "is_bf16_supported", "current_stream", "default_stream")
HARMLESS_UNDER_NVML = ("is_available", "device_count")
def recorder(name, original):
    def wrapped(*args, **kwargs):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "importlib" not in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        nvml = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == "1"
        calls.append({"call": f"torch.cuda.{name} from {where}", "harmless": nvml and name in HARMLESS_UNDER_NVML})
        return original(*args, **kwargs)
    return wrapped
for name in NAMES:
    if hasattr(torch.cuda, name):
        setattr(torch.cuda, name, recorder(name, getattr(torch.cuda, name)))
for module in json.loads(sys.argv[1]):
    __import__(module)
child = os.fork()
if child == 0:
    os._exit(10 if torch.cuda._is_in_bad_fork() else 0)
_, status = os.waitpid(child, 0)
print("PROBE " + json.dumps({"calls": calls, "initialized": torch.cuda.is_initialized(),
                             "child_bad_fork": os.waitstatus_to_exitcode(status) == 10}))
"""


def test_the_forkserver_preloads_never_initialise_cuda():
    """What the forkserver imports before it forks ranks must leave the CUDA driver alone: a driver
    initialised there (even by a mere ``cudaGetDeviceCount``) makes every forked rank a bad fork that can
    never use CUDA. With a CPU build of torch this checks the rule (every CUDA query made while importing
    goes through NVML); with a CUDA build, on a GPU machine, also the outcome (no context, no bad fork)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # the forkserver's own first preload must set it
    done = subprocess.run([sys.executable, "-c", _PRELOAD_PROBE, json.dumps(PRELOAD)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")][-1]
    probe = json.loads(line[len("PROBE "):])
    harmful = [call["call"] for call in probe["calls"] if not call["harmless"]]
    assert harmful == [] and not probe["initialized"], probe
    assert not probe["child_bad_fork"] or driverless_cuda_build(), probe
