"""The machine a command ran on, for results.json: GPUs, driver, compute mode, MIG, MPS, torch and its CUDA,
Python, nvcc, the tools. The kit's first item (``machine``) runs this file as a script:

    python environment.py            # prints MACHINE {json}

Read in child processes (torch's view in a ``python -c``, the driver's from ``nvidia-smi``), so that the
orchestrating process never imports torch or touches CUDA itself.

Why compute mode, MIG and MPS: several ranks share one GPU in most items. In Exclusive_Process mode a
second process cannot create a context there ("device busy"): those items are then not measurable, not
failed. Under MIG a rank sees one slice of the GPU (its bandwidth is the slice's). Without MPS, processes
sharing a GPU are time-sliced: their kernels do not run at the same time (items say so).
"""
from __future__ import annotations

import glob
import json
import os
import platform
import shutil
import socket
import subprocess
import sys

_TORCH_PROBE = r"""
import json, torch
info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if info["cuda_available"]:
    info["devices"] = [{"name": torch.cuda.get_device_name(i),
                        "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                        "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
                        "multiprocessors": torch.cuda.get_device_properties(i).multi_processor_count}
                       for i in range(torch.cuda.device_count())]
print("TORCH " + json.dumps(info))
"""


def _run(argv, timeout=60):
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, str(err)
    return done.returncode, done.stdout + done.stderr


def sanitizer_path():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        candidate = os.path.join(home or "", "bin", "compute-sanitizer")
        if home and os.path.exists(candidate):
            return candidate
    return None


def _has_toolkit(home: str) -> bool:
    return os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))


def cuda_home() -> dict:
    """The CUDA toolkit the JIT builds should use. torch takes ``CUDA_HOME`` (or ``CUDA_PATH``), else the
    folder above ``which nvcc``, else /usr/local/cuda. Where that guess has no ``include/cuda_runtime.h``
    (an ``nvcc`` wrapper script in /usr/local/bin, as on the machine this kit was written on: torch then
    compiles against /usr/local/include and fails), the items are given the toolkit that has it, and
    results.json says so."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return {"set": None, "how": f"${variable}={os.environ[variable]} (the environment's)"}
    nvcc = shutil.which("nvcc")
    guess = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    if _has_toolkit(guess):
        return {"set": None, "how": f"torch finds {guess}"}
    candidates = ([os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []) + \
        ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for home in candidates:
        if _has_toolkit(home) and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return {"set": home, "how": f"CUDA_HOME={home} given to the items: torch would guess {guess}, which has no "
                                       "include/cuda_runtime.h"}
    return {"set": None, "how": f"no CUDA toolkit with include/cuda_runtime.h found (torch would guess {guess})"}


SMI_FIELDS = ("name", "driver_version", "memory.total", "compute_mode", "mig.mode.current")


def nvidia_smi_view(run=None) -> dict:
    """Driver, compute mode and MIG mode of each GPU as nvidia-smi reports them (``run``: tests)."""
    code, output = (run or _run)(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"])
    if code != 0 or not output:
        return {"driver": None, "compute_modes": [], "mig": []}
    rows = [[field.strip() for field in line.split(",")] for line in output.strip().splitlines() if line.strip()]
    rows = [row for row in rows if len(row) == len(SMI_FIELDS)]
    return {"driver": rows[0][1] if rows else None, "nvidia_smi": output.strip(),
            "compute_modes": [row[3] for row in rows], "mig": [row[4] for row in rows]}


def mps_running() -> bool:
    """Whether an MPS control daemon's pipe is there (then processes on one GPU can run kernels at once)."""
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipe, "control"))


def sharing(machine: dict) -> dict:
    """What several ranks on one GPU can do here: ``shared`` (False: Exclusive_Process or Prohibited, with
    ``why``), ``time_sliced`` (no MPS), ``mig`` (some GPU has MIG enabled)."""
    modes = machine.get("compute_modes") or []
    blocked = [mode for mode in modes if mode in ("Exclusive_Process", "Prohibited")]
    why = (f"compute mode {blocked[0]}: one process per GPU, so ranks cannot share this machine's "
           f"{machine.get('gpus', 0)} GPU(s)") if blocked else ""
    return {"shared": not blocked, "why": why, "time_sliced": not machine.get("mps"),
            "mig": any(m.lower() == "enabled" for m in machine.get("mig") or [])}


def describe(python: str) -> dict:
    env = {"python": sys.version.split()[0], "python_executable": python, "host": socket.gethostname(),
           "platform": platform.platform(), "cpus": os.cpu_count()}
    code, output = _run([python, "-c", _TORCH_PROBE], timeout=180)
    lines = [line for line in (output or "").splitlines() if line.startswith("TORCH ")]
    env.update(json.loads(lines[-1][6:]) if code == 0 and lines else {"torch_error": (output or "")[-1000:]})
    env["gpus"] = len(env.get("devices", []))
    env.update(nvidia_smi_view())
    env["mps"] = mps_running()
    code, output = _run(["nvcc", "--version"])
    release = [line for line in (output or "").splitlines() if "release" in line]
    env["nvcc"] = release[-1].strip() if code == 0 and release else None
    env["compute_sanitizer"] = sanitizer_path()
    env["cuda_home"] = cuda_home()
    env["sharing"] = sharing(env)
    return env


if __name__ == "__main__":
    print("MACHINE " + json.dumps(describe(sys.executable)), flush=True)
