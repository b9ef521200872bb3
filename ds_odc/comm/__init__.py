"""Every way bytes move between ranks: the node transports (shm, cuda_ipc) with their control plane,
the cross-node link and the job's nodes. Nothing here knows about DeepSpeed, and nothing here
imports the step protocol above it (``ds_odc.runtime``): rounds and activities are numbers, named by
the :class:`~ds_odc.comm.wording.Wording` the protocol hands in."""
from __future__ import annotations

import os

import torch

from ds_odc.comm.shm import ShmTransport
from ds_odc.comm.transport import Transport, WindowSpec
from ds_odc.comm.wording import NUMBERS, Wording
from ds_odc.errors import ODCConfigError

__all__ = ["Transport", "WindowSpec", "ShmTransport", "Wording", "create_transport", "available_transports",
           "select_transport"]

#: Values of ``zero_optimization.odc.transport`` besides "auto", and the device type each serves.
TRANSPORT_DEVICES = {"shm": "cpu", "cuda_ipc": "cuda"}
_FIELD = "zero_optimization.odc.transport"


def available_transports() -> dict[str, tuple[bool, str]]:
    """``name -> (usable here, why not)`` for every transport; builds nothing (for ``ds_odc report``)."""
    shm_ok = os.path.isdir("/dev/shm")
    return {"shm": (shm_ok, "" if shm_ok else "/dev/shm does not exist (set odc.shm_dir to a tmpfs directory)"),
            "cuda_ipc": _cuda_ipc_availability()}


def _cuda_ipc_availability() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        why = ("torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible")
        return False, f"{why} (torch.cuda.is_available() is False)"
    from ds_odc.ops_builder import CUDA_IPC, op_status

    status = next(s for s in op_status() if s["name"] == CUDA_IPC.name)
    if status["built"] or status["buildable"]:
        return True, ""
    return False, f"its CUDA operator cannot be built: {status['reason']}"


def select_transport(name: str, device: str | torch.device) -> str:
    """The transport to use for ``odc.transport=name`` with shards on ``device``; ODCConfigError if
    that combination cannot work.

    >>> select_transport("auto", "cpu"), select_transport("shm", "cpu")
    ('shm', 'shm')
    """
    device_type = torch.device(device).type
    if name == "auto":
        matching = [t for t, d in TRANSPORT_DEVICES.items() if d == device_type]
        if not matching:
            raise ODCConfigError(f"{_FIELD}='auto': no ODC transport serves {device_type!r} tensors; "
                                 f"available: {_describe()}")
        name = matching[0]
    if name not in TRANSPORT_DEVICES:
        raise ODCConfigError(f"{_FIELD}={name!r} is not a transport; allowed: 'auto', "
                             + ", ".join(repr(t) for t in TRANSPORT_DEVICES))
    if TRANSPORT_DEVICES[name] != device_type:
        raise ODCConfigError(f"{_FIELD}={name!r} serves {TRANSPORT_DEVICES[name]} tensors, but the model's shards are "
                             f"on {str(device)!r}; use 'auto' (picks by device) or {_describe()}")
    usable, why = available_transports()[name]
    if not usable:
        raise ODCConfigError(f"{_FIELD}={name!r} is not available here: {why}")
    return name


def _describe() -> str:
    return ", ".join(f"{t!r} ({d} tensors)" for t, d in TRANSPORT_DEVICES.items())


def create_transport(name: str, *, rank: int, world_size: int, timeout_s: float, device: str = "cpu",
                     shm_dir: str = "/dev/shm", stripe_numel: int = 1 << 20, group=None,
                     first_rank: int = 0, wording: Wording = NUMBERS) -> Transport:
    """Build the transport named in ``odc.transport`` ("auto" picks by the device of the shards:
    CPU -> "shm", CUDA -> "cuda_ipc"). ``device`` is where the shards live, e.g. "cpu" or "cuda:1".
    ``rank`` and ``world_size`` are within ``group``, the ranks of one node (default: every rank);
    ``first_rank`` is the job's rank of the node's rank 0, so that errors name job ranks; ``wording``
    names round kinds and activities in its errors."""
    name = select_transport(name, device)
    if name == "shm":
        return ShmTransport(rank, world_size, timeout_s, shm_dir=shm_dir, stripe_numel=stripe_numel, group=group,
                            first_rank=first_rank, wording=wording)
    from ds_odc.comm.cuda_ipc import CudaIpcTransport

    return CudaIpcTransport(rank, world_size, timeout_s, device=device, shm_dir=shm_dir, group=group,
                            first_rank=first_rank, wording=wording)
