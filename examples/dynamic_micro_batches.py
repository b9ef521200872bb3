"""An RL-style actor update with dynamic micro-batches, without padding the micro-batch count.

RL frameworks that drive ``deepspeed.initialize`` themselves (OpenRLHF's ``--use_dynamic_batch``,
verl's ``use_dynamic_bsz``) give every rank its own rollouts, of very different lengths, and pack
each rank's samples into micro-batches under a token budget (``--max_token_len`` here). Ranks then
need different numbers of micro-batches. Under ZeRO-3 every rank must run the same number (each
layer of each micro-batch is a collective), so today they all-reduce the MAX count and make up the
difference: a short rank splits its micro-batches into more, smaller ones, or runs dummy ones.

On ODC ranks meet only at ``engine.step()``, so each rank runs exactly the micro-batches its own
packing produced, with no collective before the step::

    for batch in my_micro_batches:                     # 2 on one rank, 9 on another
        engine.backward(loss_sum(engine, batch), loss_tokens=tokens(batch))
    engine.step()

``loss_tokens`` makes the update the per-token mean over every rank's tokens (the step divides the
globally summed gradient by the global token count), which is what the padded loop has to
all-reduce the token count for.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/dynamic_micro_batches.py                # ODC, unpadded
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/dynamic_micro_batches.py --mode padded --stage 3

Each step prints every rank's micro-batch count, tokens, time in forward/backward, the step's wall
time and the global loss per token. ``tests/distributed/test_dynamic_micro_batches.py`` checks that
both loops give the same weights as one process on all ranks' samples.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Callable, Optional, Sequence, Union

import deepspeed
import torch
from deepspeed import comm as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ds_odc  # noqa: E402,F401  registers the "odc" stage

from packed_lm import PackedCausalLM, loss_sum, make_sample, pack  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config_odc.json")
MODES = ("unpadded", "padded")


# -- rollouts and packing: what the framework already does, rank by rank ---------------------------
def make_rollouts(step: int, rank: int, world: int, count: int, max_token_len: int, seed: int = 0) -> list:
    """This rank's ``count`` rollouts for ``step``: token tensors of ``length + 1`` tokens (input and
    shifted target), deterministic in (seed, step, rank). Lengths are long-tailed and grow with the
    rank: the last rank's responses are about 4x longer than rank 0's, so ranks hold very different
    numbers of tokens, as rollouts of different prompts do."""
    rng = random.Random(seed * 1_000_003 + step * 1_009 + rank)
    share = 0.08 + 0.27 * (rank / max(world - 1, 1))  # mean length as a share of the budget
    samples = []
    for i in range(count):
        length = min(max_token_len, max(2, round(rng.lognormvariate(math.log(share * max_token_len), 0.6))))
        samples.append(make_sample(seed * 10**9 + step * 10**6 + rank * 10**4 + i, length))
    return samples


def first_fit_decreasing(lengths: list[int], max_token_len: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches of at most ``max_token_len`` tokens, longest
    sample first into the first micro-batch it fits (each sample fits on its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        slot = next((b for b, free in enumerate(room) if free >= lengths[index]), None)
        if slot is None:
            bins.append([])
            room.append(max_token_len)
            slot = len(bins) - 1
        bins[slot].append(index)
        room[slot] -= lengths[index]
    return bins


def pack_rollouts(samples: list, max_token_len: int) -> list[list]:
    """This rank's rollouts as micro-batches (lists of samples) under the token budget."""
    return [[samples[i] for i in group] for group in first_fit_decreasing([len(s) - 1 for s in samples],
                                                                          max_token_len)]


def pad_to_count(micro_batches: list[list], count: int) -> tuple[list[list], int]:
    """The ZeRO-3 way of reaching ``count`` micro-batches: split the largest micro-batch in two while
    one holds more than a sample (what OpenRLHF and verl do by partitioning into the MAX count), then
    add dummy micro-batches (``None``) if the rank has fewer samples than ``count``."""
    micro_batches = [list(mb) for mb in micro_batches]
    while len(micro_batches) < count:
        largest = max(range(len(micro_batches)), key=lambda b: len(micro_batches[b]), default=None)
        if largest is None or len(micro_batches[largest]) < 2:
            break
        batch = micro_batches.pop(largest)
        micro_batches += [batch[::2], batch[1::2]]
    dummies = count - len(micro_batches)
    return micro_batches + [None] * dummies, dummies


DUMMY = [make_sample(0, 1)]  # one token, weighted zero: it only makes the rank join the collectives


# -- the actor update: one optimizer step -----------------------------------------------------------
def actor_update(engine, micro_batches: list[list], mode: str) -> dict:
    """Forward/backward over this rank's micro-batches, then one ``engine.step()``.

    ``unpadded`` (ODC only): each rank runs its own micro-batches, ``engine.backward(loss_sum,
    loss_tokens=n)``; no collective before the step. ``padded`` (ZeRO-3's loop, runs on either
    stage): all ranks exchange their micro-batch and token counts, pad to the MAX count, and scale
    each summed loss by ``world / global_tokens`` so that DeepSpeed's average over ranks is the global
    per-token mean."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "unpadded" and not hasattr(engine, "set_loss_tokens"):
        raise ValueError("the unpadded loop needs an ODC engine (\"stage\": \"odc\"): under ZeRO-3 ranks running "
                         "different micro-batch counts hang in the per-layer collectives")
    start = time.perf_counter()
    tokens = sum(len(s) - 1 for mb in micro_batches for s in mb)
    record = {"packed": len(micro_batches), "tokens": tokens, "dummies": 0}
    if mode == "padded":
        world = dist.get_world_size()
        counts = torch.tensor([len(micro_batches), tokens], dtype=torch.long)
        gathered = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(gathered, counts)  # the collective the unpadded loop does without
        max_count = max(int(c[0]) for c in gathered)
        scale = world / max(sum(int(c[1]) for c in gathered), 1)
        micro_batches, record["dummies"] = pad_to_count(micro_batches, max_count)
    total, busy = 0.0, 0.0
    for samples in micro_batches:
        begin = time.perf_counter()
        if samples is None:  # dummy: same collectives as a real micro-batch, zero gradient
            engine.backward(loss_sum(engine, pack(DUMMY)) * 0.0)
        else:
            batch = pack(samples)
            loss = loss_sum(engine, batch)
            if mode == "padded":
                engine.backward(loss * scale)
            else:
                engine.backward(loss, loss_tokens=len(batch[1]))
            total += loss.item()
        busy += time.perf_counter() - begin
    engine.step()
    record.update(ran=len(micro_batches), loss_sum=total, busy_s=busy, step_s=time.perf_counter() - start)
    return record


def rollout_count(rollouts_per_rank: Union[int, Sequence[int]], rank: int) -> int:
    """One count for every rank, or one per rank (ranks may hold different numbers of rollouts, e.g.
    after filtering; a rank with fewer samples than the MAX micro-batch count needs dummies to pad)."""
    return rollouts_per_rank if isinstance(rollouts_per_rank, int) else rollouts_per_rank[rank]


def train(engine, steps: int, mode: str, rollouts_per_rank: Union[int, Sequence[int]], max_token_len: int,
          seed: int = 0, on_step: Optional[Callable[[int, dict], None]] = None) -> list[dict]:
    """``steps`` actor updates on this rank's own rollouts; ``on_step(step, record)`` after each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    records = []
    for step in range(steps):
        samples = make_rollouts(step, rank, world, rollout_count(rollouts_per_rank, rank), max_token_len, seed)
        record = actor_update(engine, pack_rollouts(samples, max_token_len), mode)
        records.append(record)
        if on_step is not None:
            on_step(step, record)
    return records


def build_model(max_token_len: int, seed: int = 0, **model_kw) -> PackedCausalLM:
    torch.manual_seed(seed)
    return PackedCausalLM(max_len=max_token_len, **model_kw)


def load_config(stage, path: str = CONFIG) -> dict:
    """``ds_config_odc.json`` with its stage replaced (``"odc"`` or 3)."""
    with open(path) as config_file:
        config = json.load(config_file)
    zero = config["zero_optimization"]
    zero["stage"] = stage
    if stage != "odc":
        zero.pop("odc", None)
    return config


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", default="unpadded", choices=MODES)
    parser.add_argument("--stage", default="odc", choices=["odc", "3"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rollouts_per_rank", default="16",
                        help="rollouts each rank holds per step: one number, or one per rank (e.g. 2,16)")
    parser.add_argument("--max_token_len", type=int, default=512, help="token budget of one micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deepspeed_config", default=CONFIG)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    stage = "odc" if args.stage == "odc" else 3
    rollouts = [int(n) for n in args.rollouts_per_rank.split(",")]
    if stage == 3 and args.mode == "unpadded":
        parser.error("--stage 3 needs --mode padded: ZeRO-3 gathers every layer of every micro-batch "
                     "collectively, so ranks running different micro-batch counts would hang")

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if len(rollouts) not in (1, world):
        parser.error(f"--rollouts_per_rank: one number or {world} (one per rank), got {args.rollouts_per_rank}")
    rollouts = rollouts[0] if len(rollouts) == 1 else rollouts
    model = build_model(args.max_token_len, args.seed)
    engine, *_ = deepspeed.initialize(model=model, config=load_config(stage, args.deepspeed_config))
    if rank == 0:
        print(f"engine: {type(engine).__name__}, zero stage {engine.zero_optimization_stage()}, {world} ranks, "
              f"{args.mode} micro-batches under {args.max_token_len} tokens", flush=True)

    def report(step, record):
        gathered = [None] * world
        dist.all_gather_object(gathered, record)  # for the log line only, after the step
        if rank == 0:
            counts = "/".join(str(r["ran"]) for r in gathered)
            extra = [f"{r['ran'] - r['packed'] - r['dummies']}+{r['dummies']}" for r in gathered]
            if any(r["ran"] != r["packed"] for r in gathered):
                counts += f" (packed {'/'.join(str(r['packed']) for r in gathered)}, split+dummy {'/'.join(extra)})"
            tokens = sum(r["tokens"] for r in gathered)
            print(f"step {step:3d} | micro-batches {counts} | tokens {'/'.join(str(r['tokens']) for r in gathered)}"
                  f" | loss/token {sum(r['loss_sum'] for r in gathered) / tokens:.4f}"
                  f" | fwd+bwd s {'/'.join(format(r['busy_s'], '.2f') for r in gathered)}"
                  f" | step s {max(r['step_s'] for r in gathered):.2f}", flush=True)

    records = train(engine, args.steps, args.mode, rollouts, args.max_token_len, args.seed, report)
    if rank == 0 and len(records) > 1:
        print(f"mean step time after the first: {sum(r['step_s'] for r in records[1:]) / (len(records) - 1):.3f} s")
    engine.destroy()


if __name__ == "__main__":
    main()
