"""The machine a phase ran on, for results.json: GPUs, driver, torch and its CUDA, Python, nvcc, the tools.

Read in child processes (torch's view in a ``python -c``, the driver's from ``nvidia-smi``), so that the
orchestrating process never imports torch or touches CUDA itself.
"""
from __future__ import annotations

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


def describe(python: str) -> dict:
    env = {"python": sys.version.split()[0], "python_executable": python, "host": socket.gethostname(),
           "platform": platform.platform(), "cpus": os.cpu_count()}
    code, output = _run([python, "-c", _TORCH_PROBE], timeout=180)
    lines = [line for line in (output or "").splitlines() if line.startswith("TORCH ")]
    env.update(json.loads(lines[-1][6:]) if code == 0 and lines else {"torch_error": (output or "")[-1000:]})
    env["gpus"] = len(env.get("devices", []))
    code, output = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    if code == 0:
        rows = [line.split(", ") for line in output.strip().splitlines()]
        env["driver"] = rows[0][1] if rows and len(rows[0]) > 1 else output.strip()
        env["nvidia_smi"] = output.strip()
    else:
        env["driver"] = None
    code, output = _run(["nvcc", "--version"])
    release = [line for line in (output or "").splitlines() if "release" in line]
    env["nvcc"] = release[-1].strip() if code == 0 and release else None
    env["compute_sanitizer"] = sanitizer_path()
    return env
