"""Rank-side workloads for deterministic accumulation (``odc.deterministic``, or
``torch.use_deterministic_algorithms(True)``): the same job twice, ranks delayed at random differently in each
run so that pushes reach their owners in other orders; the runs must agree bit for bit."""
from __future__ import annotations

import random
import time

import deepspeed
import torch
import torch.distributed as tdist

from tests.support.workloads import (
    REFERENCE_CLIP,
    REFERENCE_OPTIMIZER,
    ds_config,
    full_params,
    make_model,
    micro_batch,
    mse_token_sum,
)


def train_once(counts, steps: int, delay_seed: int, via: str, masked=(), max_delay_s: float = 0.03) -> dict:
    """Ranks run ``counts[rank]`` micro-batches per step (per-token loss, unmanaged accumulation), each
    micro-batch after a random sleep drawn from ``delay_seed``. ``via``: "config" (``odc.deterministic``),
    "torch" (``torch.use_deterministic_algorithms(True)`` at initialize), or "fp32" (the default accumulator).
    Returns every micro-batch's loss and the parameters after every step."""
    rank = tdist.get_rank()
    odc = {"deterministic": True} if via == "config" else {}
    config = ds_config("odc", managed=False, optimizer=REFERENCE_OPTIMIZER, clip=REFERENCE_CLIP, odc=odc)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(via == "torch" or before)
    try:
        engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    finally:
        torch.use_deterministic_algorithms(before)
    delays = random.Random(1000 * delay_seed + rank)
    losses, history = [], []
    for step in range(steps):
        for index in range(counts[rank]):
            time.sleep(delays.uniform(0.0, max_delay_s))
            x, y, mask = micro_batch(step, rank, index, masked_out=(rank, index) in masked)
            loss = mse_token_sum(engine(x), y, mask)
            engine.backward(loss, loss_tokens=int(mask.sum().item()))
            losses.append(float(loss.item()))
        engine.step()
        history.append(full_params(engine))
    exact = engine.odc_runtime.exact
    engine.destroy()
    return {"losses": losses, "params": history, "exact": exact}


def train_twice(counts, steps: int = 3, via: str = "config", masked=()) -> list:
    """:func:`train_once` with two different delay seeds."""
    return [train_once(counts, steps, seed, via, masked) for seed in (1, 2)]
