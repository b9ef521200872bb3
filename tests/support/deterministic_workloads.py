"""Rank-side workloads for deterministic accumulation (``odc.deterministic``, or
``torch.use_deterministic_algorithms(True)``): the same job twice, the ranks starting each step in one order in
the first run and in the reverse order in the second (plus a random jitter per micro-batch), so that pushes reach
their owners in other orders; the runs must agree bit for bit. The order is forced, not left to random sleeps:
with sleeps alone two fp32 runs once summed in the same order and the control saw the same bits."""
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
    summed_grads,
)

STAGGER_S = 0.25  # between ranks' starts of a step: far above a micro-batch of the test model on CI's 2 cores


def train_once(counts, steps: int, delay_seed: int, via: str, rank_order, masked=(), max_delay_s: float = 0.01) -> dict:
    """Ranks run ``counts[rank]`` micro-batches per step (per-token loss, unmanaged accumulation), each
    micro-batch after a random sleep drawn from ``delay_seed``; the rank at position k of ``rank_order`` starts
    each step ``k * STAGGER_S`` after the first. ``via``: "config" (``odc.deterministic``),
    "torch" (``torch.use_deterministic_algorithms(True)`` at initialize), or "fp32" (the default accumulator).
    Returns every micro-batch's loss, the summed gradients each step reads (:func:`summed_grads`) and the
    parameters after every step."""
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
    losses, history, grads = [], [], []
    start_delay = STAGGER_S * list(rank_order).index(rank)
    for step in range(steps):
        time.sleep(start_delay)
        for index in range(counts[rank]):
            time.sleep(delays.uniform(0.0, max_delay_s))
            x, y, mask = micro_batch(step, rank, index, masked_out=(rank, index) in masked)
            loss = mse_token_sum(engine(x), y, mask)
            engine.backward(loss, loss_tokens=int(mask.sum().item()))
            losses.append(float(loss.item()))
        grads.append(summed_grads(engine))
        engine.step()
        history.append(full_params(engine))
    exact = engine.odc_runtime.exact
    engine.destroy()
    return {"losses": losses, "params": history, "grads": grads, "exact": exact}


def train_twice(counts, steps: int = 3, via: str = "config", masked=()) -> list:
    """:func:`train_once` twice: ranks in ascending order of start, then descending, other delay seeds."""
    ascending = list(range(tdist.get_world_size()))
    return [train_once(counts, steps, seed, via, order, masked)
            for seed, order in ((1, ascending), (2, ascending[::-1]))]
