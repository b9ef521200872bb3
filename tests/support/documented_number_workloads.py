"""Rank-side workloads for ``tests/distributed/test_documented_numbers.py``: documented promises that no other test
could catch breaking (the project's issue 47).

* the gathered-mean rule under sequence parallelism at uneven counts (``sp_workloads``' engine and data, SP groups
  running 1 and 3 micro-batches, DeepSpeed's managed accumulation), and its one-process reference;
* a model with a buffer that training updates, through the universal checkpoint at another world size
  (``checkpoint_workloads``' global batch of ``SLOTS`` micro-batches);
* the monitor's push bytes with and without ``deterministic`` sums, and the bytes that reach the owners' windows.
"""
from __future__ import annotations

import os
from typing import List, Sequence

import deepspeed
import torch
import torch.distributed as tdist
import torch.nn.functional as F

from tests.support import sp_workloads as sp
from tests.support.checkpoint_workloads import SLOTS, _train_slots
from tests.support.workloads import Net, ds_config, full_params, make_model, micro_batch, mse_mean


# -- sequence parallelism: the gathered-mean rule at uneven counts --------------------------------------------------
def train_gathered_mean_uneven(counts: Sequence[int], gas: int, steps: int = 3) -> dict:
    """SP group g runs ``counts[g]`` micro-batches per step, HF's gathered token-mean loss on both of its ranks,
    managed accumulation of ``gas`` with each rank setting the boundary on its own last micro-batch (accelerate's
    pattern for uneven counts). Parameters after every step, and the samples counted."""
    engine, mpu = sp.sp_engine("odc", gas=gas)
    rank, sp_rank = tdist.get_rank(), mpu.get_sequence_parallel_rank()
    group, history = rank // sp.SP, []
    for step in range(steps):
        for index in range(counts[group]):
            engine.set_gradient_accumulation_boundary(index == counts[group] - 1)
            ids, labels = sp.sequence(step, group, index)
            engine.backward(sp.gathered_mean_loss(engine, ids, labels, sp_rank, mpu.get_sequence_parallel_group()))
            engine.step()
        history.append(sp.full_parameters(engine))
    result = {"params": history, "global_samples": engine.global_samples}
    engine.destroy()
    return result


def reference_gathered_mean(counts: Sequence[int], steps: int = 3, lr: float = 0.05) -> List[dict]:
    """One process, full sequences, SGD: the mean over every sequence of the step of that sequence's token mean
    (the mean rule: each micro-batch's loss is one sequence's mean, the step averages the micro-batches)."""
    model = sp.tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    history = []
    for step in range(steps):
        optimizer.zero_grad()
        means = []
        for group, count in enumerate(counts):
            for index in range(count):
                ids, labels = sp.sequence(step, group, index)
                logits = model(input_ids=ids).logits.float()
                means.append(F.cross_entropy(logits.reshape(-1, sp.VOCAB), labels.reshape(-1),
                                             ignore_index=sp.IGNORE, reduction="mean"))
        torch.stack(means).mean().backward()
        optimizer.step()
        history.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return history


# -- a buffer through the universal checkpoint ----------------------------------------------------------------------
class WeightAverageLinear(torch.nn.Linear):
    """A linear layer with two buffers that training updates: at the first forward after its weight changed (once
    per optimizer step, the same on every rank and at every world size: the weights are), ``average`` moves half
    way to the weight's mean and ``seen`` keeps that mean. Its output is scaled by ``1 + average``: a buffer left
    at its initial value changes every loss after the load."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("average", torch.zeros(()))
        self.register_buffer("seen", torch.full((), float("nan")))

    def forward(self, x):
        mean = self.weight.detach().float().mean()  # inside its own forward: ZeRO-3 / ODC gathered the weight
        if not torch.equal(mean, self.seen):
            self.average.mul_(0.5).add_(mean, alpha=0.5)
            self.seen.copy_(mean)
        return super().forward(x) * (1.0 + self.average)


def buffered_model(seed: int = 1234) -> Net:
    """``workloads.Net`` (its frozen layer included) whose input layer is a :class:`WeightAverageLinear`."""
    torch.manual_seed(seed)
    model = Net()
    inp = model.inp
    model.inp = WeightAverageLinear(inp.in_features, inp.out_features)
    with torch.no_grad():
        model.inp.weight.copy_(inp.weight)
        model.inp.bias.copy_(inp.bias)
    return model


def _buffered_engine(seed: int, universal: bool):
    config = ds_config("odc", gas=SLOTS // tdist.get_world_size(), scheduler=True)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=buffered_model(seed), config=config)
    return engine


def _buffers(engine) -> dict:
    return {name: buffer.detach().clone() for name, buffer in engine.module.named_buffers()}


def buffered_train(ckpt_dir: str, load_tag: str | None, first_step: int, save_after: int, then: int) -> dict:
    """A fresh engine (other initial weights and fresh buffers when it loads) that loads ``load_tag`` (universal)
    if given, trains ``save_after`` steps from ``first_step``, saves tag ``saved``, and trains ``then`` more.
    Returns the buffers at the load, at the save and at the end, the weights at the load and the end, and this
    rank's slot losses."""
    engine = _buffered_engine(seed=999 if load_tag else 1234, universal=load_tag is not None)
    result = {}
    if load_tag:
        engine.load_checkpoint(ckpt_dir, tag=load_tag)
        result.update(loaded=full_params(engine), loaded_buffers=_buffers(engine))
    losses = _train_slots(engine, first_step, save_after)
    if then:
        engine.save_checkpoint(ckpt_dir, tag="saved")
        result["saved_buffers"] = _buffers(engine)
        losses.update(_train_slots(engine, first_step + save_after, then))
    result.update(losses=losses, final=full_params(engine), final_buffers=_buffers(engine))
    engine.destroy()
    return result


# -- push bytes under deterministic sums ----------------------------------------------------------------------------
def push_bytes_with_and_without_deterministic(out_dir: str, counts: Sequence[int], steps: int = 2) -> dict:
    """The same job twice in these ranks, ``deterministic`` off then on, each with DeepSpeed's CSV monitor under
    ``out_dir/<deterministic>``: rank r runs ``counts[r]`` micro-batches per step. Returns, per run, the push
    bytes of each step's report, the bytes that reached the owners' windows (every ``transport.accumulate``), whether
    the runtime summed exactly, and the trainable gradient bytes of one micro-batch."""
    rank = tdist.get_rank()
    runs = {}
    for deterministic in (False, True):
        config = ds_config("odc", managed=False, optimizer="sgd", clip=0.0, odc={"deterministic": deterministic})
        config["csv_monitor"] = {"enabled": True, "output_path": os.path.join(out_dir, str(deterministic)),
                                 "job_name": "job"}
        engine, *_ = deepspeed.initialize(model=make_model(), config=config)
        runtime = engine.optimizer.odc
        landed = {"bytes": 0}
        accumulate = runtime.transport.accumulate

        def counted(owner, offset, tensor, __accumulate=accumulate, __landed=landed):
            __landed["bytes"] += tensor.numel() * tensor.element_size()
            return __accumulate(owner, offset, tensor)

        runtime.transport.accumulate = counted
        for step in range(steps):
            for index in range(counts[rank]):
                x, y, _ = micro_batch(step, rank, index)
                engine.backward(mse_mean(engine(x), y))
            engine.step()
        runs[deterministic] = {
            "push_bytes": [report.counter("push_bytes") for report in engine.odc_metrics.reports],
            "landed_bytes": landed["bytes"], "exact": runtime.exact,
            "gradient_bytes": sum(p.ds_numel * 4 for p in engine.module.parameters() if p.requires_grad)}
        runtime.transport.accumulate = accumulate
        engine.destroy()
    return runs
