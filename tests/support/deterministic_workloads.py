"""Rank-side workloads for deterministic accumulation (``odc.deterministic``, or
``torch.use_deterministic_algorithms(True)``): the same job twice, the ranks starting each step in one order in
the first run and in the reverse order in the second (plus a random jitter per micro-batch), so that pushes reach
their owners in other orders; the runs must agree bit for bit. The order is forced, not left to sleeps: with
random sleeps alone, and later with a fixed stagger between ranks' starts, two fp32 runs on a busy machine once
summed in the same order and the control saw the same bits. Now a rank starts a step only when the rank before it
in the order has finished its micro-batches (a push has landed when ``backward`` returns)."""
from __future__ import annotations

import random
import shutil
import tempfile
import time

import deepspeed
import torch
import torch.distributed as tdist

from ds_odc.comm.schedule import Schedule
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

TURN_TIMEOUT_S = 120.0  # a rank waiting for its turn: far above a step of the test model on a busy machine


def _turns() -> Schedule:
    """Signals in one directory every rank sees (rank 0 makes it), for passing the turn."""
    directory = [tempfile.mkdtemp(prefix="odc-turns-") if tdist.get_rank() == 0 else None]
    tdist.broadcast_object_list(directory, src=0)
    return Schedule(directory[0])


def train_once(counts, steps: int, delay_seed: int, via: str, rank_order, masked=(), max_delay_s: float = 0.01) -> dict:
    """Ranks run ``counts[rank]`` micro-batches per step (per-token loss, unmanaged accumulation), each
    micro-batch after a random sleep drawn from ``delay_seed``; the rank at position k of ``rank_order`` starts
    each step when the rank at position k-1 has finished its micro-batches, so every owner receives the step's
    pushes in that order. ``via``: "config" (``odc.deterministic``),
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
    position = list(rank_order).index(rank)
    turns = _turns()
    try:
        engine.odc_runtime.open()  # the open round meets every rank: run it now, not inside the first turn
        for step in range(steps):
            if position:
                turns.wait(f"step{step}-done{position - 1}", TURN_TIMEOUT_S, f"rank {rank} waiting for its turn")
            for index in range(counts[rank]):
                time.sleep(delays.uniform(0.0, max_delay_s))
                x, y, mask = micro_batch(step, rank, index, masked_out=(rank, index) in masked)
                loss = mse_token_sum(engine(x), y, mask)
                engine.backward(loss, loss_tokens=int(mask.sum().item()))
                losses.append(float(loss.item()))
            turns.post(f"step{step}-done{position}")
            grads.append(summed_grads(engine))
            engine.step()
            history.append(full_params(engine))
        exact = engine.odc_runtime.exact
        engine.destroy()
        tdist.barrier()  # every rank is past its last turn
    finally:
        if rank == 0:
            shutil.rmtree(turns.directory, ignore_errors=True)
    return {"losses": losses, "params": history, "grads": grads, "exact": exact}


def train_twice(counts, steps: int = 3, via: str = "config", masked=()) -> list:
    """:func:`train_once` twice: ranks in ascending order of start, then descending, other delay seeds."""
    ascending = list(range(tdist.get_world_size()))
    return [train_once(counts, steps, seed, via, order, masked)
            for seed, order in ((1, ascending), (2, ascending[::-1]))]
