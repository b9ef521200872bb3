"""Bytes per token of a model's saved activations, and the host copy rate: measured once, at the start.

Guessing bytes per token from a model's shape misses what autograd really keeps (dropout masks, softmax
outputs, an attention kernel's extra tensors, what activation checkpointing leaves). So the first
micro-batch's forward is run once more with hooks that only count (:func:`~ds_odc.activations.hooks.counting_hooks`),
its graph dropped, the random number generators put back as they were (a model with dropout draws the same
masks in the real forward), and the sizes divided by its token count. The profile keeps every saved
storage's share in save order, so a decision can name the first k tensors (:mod:`~ds_odc.activations.policy`).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ds_odc.activations.hooks import counting_hooks
from ds_odc.activations.policy import SavedProfile

#: Bytes timed for the copy rate (large enough to dwarf launch latency, small enough to be quick).
RATE_PROBE_BYTES = 8 << 20


def measure_profile(run_forward: Callable[[], object], tokens: int, device, is_parameter: Callable,
                    eligible: Callable) -> SavedProfile:
    """Run ``run_forward()`` (a training forward of ``tokens`` tokens) under counting hooks; its output is
    dropped. Random number generators (CPU and, where used, CUDA) are restored afterwards."""
    if tokens < 1:
        raise ValueError(f"calibration needs a micro-batch with at least one token, got {tokens}")
    sizes: list[int] = []
    kept: list[int] = []
    device = torch.device(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
            counting_hooks(device, is_parameter, eligible, sizes, kept):
        output = run_forward()
    del output
    return SavedProfile(tuple(size / tokens for size in sizes), sum(kept) / tokens)


def measure_copy_rate(device, pin: bool, nbytes: int = RATE_PROBE_BYTES) -> float:
    """Bytes per second of one device-to-host plus host-to-device round trip's slower leg (a host-to-host
    copy on CPU), the median of three."""
    device = torch.device(device)
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(3):
        synchronize()
        start = time.perf_counter()
        host.copy_(source, non_blocking=pin)
        synchronize()
        middle = time.perf_counter()
        source.copy_(host, non_blocking=pin)
        synchronize()
        times.append(max(middle - start, time.perf_counter() - middle))
    return nbytes / max(sorted(times)[1], 1e-9)

