"""The transports the conformance suite runs on, one entry each: a new transport joins every
conformance test by adding one :class:`TransportCase` to :data:`CASES`.

A case says where the transport's windows live and how its ranks are placed; a test takes
:data:`TRANSPORTS` as its parameter list, so a transport this machine cannot run is skipped with the
reason (``cuda_ipc`` without a CUDA device), never silently dropped.

Placement of GPU ranks: DeepSpeed's CUDA accelerator, gloo for the (start-up only) collectives and,
when there are fewer GPUs than ranks, every rank on GPU 0 (processes may share one GPU through CUDA
IPC; NCCL could not). A run whose environment names the CUDA accelerator is spawned, not forked from
the CPU-preloaded forkserver (``tests/support/harness.py``).

The training, fault and smoke tests of ``tests/gpu`` run on :func:`gpu_suite_case`: ``cuda_ipc``, or the
transport named by ``ODC_GPU_SUITE_TRANSPORT`` (the validation kit's ``--cpu-smoke`` sets ``shm``, so
that CI runs the same tests end to end on CPU ranks; ``scripts/gpu_validate.py``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch


def gpu_env(world: int) -> dict:
    env = {"DS_ACCELERATOR": "cuda"}
    if torch.cuda.device_count() < world:
        env["LOCAL_RANK"] = "0"  # every rank on GPU 0; DeepSpeed places the engine by LOCAL_RANK
    return env


def rank_device() -> torch.device:
    """The GPU of this rank, consistent with :func:`gpu_env` (called in the rank)."""
    import torch.distributed as tdist

    count = torch.cuda.device_count()
    index = tdist.get_rank() if count >= tdist.get_world_size() else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@dataclass(frozen=True)
class TransportCase:
    name: str
    device_type: str
    usable: Callable[[], bool]
    why_not: str
    exclusive_pushes: bool = False
    """Its ``push_guard`` excludes other pushers (locks); False where pushes are atomic adds."""
    env: Callable[[int], Optional[dict]] = lambda world: None
    device: Callable[[], torch.device] = lambda: torch.device("cpu")


CASES = {
    "shm": TransportCase("shm", "cpu", lambda: True, "", exclusive_pushes=True),
    "cuda_ipc": TransportCase("cuda_ipc", "cuda", torch.cuda.is_available, "cuda_ipc needs a CUDA device",
                              env=gpu_env, device=rank_device),
}

#: The parameter list of every conformance test.
TRANSPORTS = [pytest.param(name, id=name, marks=pytest.mark.skipif(not case.usable(), reason=case.why_not))
              for name, case in CASES.items()]


def rank_env(name: str, world: int) -> Optional[dict]:
    """Environment of the ranks of a ``world``-rank test on transport ``name``."""
    return CASES[name].env(world)


#: Which transport the tests of tests/gpu run on (see the module docstring).
SUITE_TRANSPORT_ENV = "ODC_GPU_SUITE_TRANSPORT"


def gpu_suite_case() -> TransportCase:
    name = os.environ.get(SUITE_TRANSPORT_ENV, "cuda_ipc")
    if name not in CASES:
        raise ValueError(f"{SUITE_TRANSPORT_ENV}={name!r}: expected one of {sorted(CASES)}")
    return CASES[name]


def gpu_suite_skip():
    """The skip mark of a tests/gpu module: skipped, with the reason, where its transport cannot run."""
    case = gpu_suite_case()
    return pytest.mark.skipif(not case.usable(), reason=case.why_not)
