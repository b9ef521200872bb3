"""Shared-memory segments: files in a tmpfs directory, mapped as tensors.

Lifecycle that leaves nothing behind: the owner creates its file, every rank maps it, and the owner
unlinks it as soon as all ranks hold a mapping. From then on the memory lives exactly as long as
the mappings do, so no exit path (normal, exception, SIGKILL) can leave a file in ``/dev/shm``.
The only window for a leak is a crash during :meth:`ShmTransport.allocate` itself, which unlinks
in its own error path.
"""
from __future__ import annotations

import os

import torch

SEGMENT_PREFIX = "ds_odc_"


def segment_path(directory: str, session: str, rank: int, kind: str) -> str:
    """Path of one rank's segment, e.g. ``/dev/shm/ds_odc_3fa9c1_r1_params``."""
    return os.path.join(directory, f"{SEGMENT_PREFIX}{session}_r{rank}_{kind}")


def create_segment(path: str, nbytes: int) -> None:
    """Create a zero-filled file of ``nbytes`` bytes (tmpfs pages are allocated on first touch)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
    finally:
        os.close(fd)


def map_segment(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Map ``numel`` elements of ``dtype`` from ``path``; writes are visible to every mapper."""
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
