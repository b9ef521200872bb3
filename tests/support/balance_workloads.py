"""Rank workloads for the balancer and metrics tests: variable-length samples fed through the
balanced batch sampler, and straggler runs that the step recorder must explain."""
from __future__ import annotations

import logging
import time

import deepspeed
import torch
import torch.distributed as tdist
from torch.utils.data import DataLoader

import ds_odc.metrics
from ds_odc.balance import BalancedBatchSampler, CostModel
from tests.support.workloads import (
    IN,
    OUT,
    clip_like_deepspeed,
    ds_config,
    full_params,
    make_model,
    micro_batch,
    mse_mean,
)

LENGTHS = [1, 9, 2, 3, 8, 2, 1, 5, 6, 1, 1, 1, 9, 4, 2, 2]  # rows per sample: long-tailed, cap 10
TOKEN_CAP = 10
SAMPLES_PER_RANK = 4


def sample(index: int):
    """Sample ``index``: LENGTHS[index] rows of (x, y); the loss is a per-row sum."""
    gen = torch.Generator().manual_seed(777 + index)
    rows = LENGTHS[index]
    return torch.randn(rows, IN, generator=gen), torch.randn(rows, OUT, generator=gen)


def collate(samples):
    return torch.cat([x for x, _ in samples]), torch.cat([y for _, y in samples])


def row_loss_sum(pred, y):
    return ((pred.float() - y) ** 2).sum()


def train_balanced(policy: str, epochs: int = 1):
    """Per-token (per-row) normalisation over a sampler-planned epoch; returns params and the micro-batch
    counts this rank ran per step."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc", managed=False, micro=1))
    sampler = BalancedBatchSampler(LENGTHS, samples_per_rank=SAMPLES_PER_RANK, token_cap=TOKEN_CAP, policy=policy,
                                   cost_model=CostModel.quadratic_linear(1.0, 4.0), world_size=world, rank=rank, seed=3)
    loader = DataLoader([sample(i) for i in range(len(LENGTHS))], batch_sampler=sampler, collate_fn=collate)
    counts = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step_batches in sampler.group_steps(loader):
            for x, y in step_batches:
                engine.backward(row_loss_sum(engine(x), y), loss_tokens=x.shape[0])
            engine.step()
            counts.append(len(step_batches))
    plans = [[list(map(list, rank_batches)) for rank_batches in plan.micro_batches] for plan, _ in sampler.plans()]
    members = [m for _, m in sampler.plans()]
    result = {"params": full_params(engine), "counts": counts, "plans": plans, "members": members}
    engine.destroy()
    return result


def reference_balanced(step_members, lr=1e-2, clip=1.0):
    """Single process: each step's samples (dataset indices) in one batch, per-row mean loss."""
    model = make_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    for members in step_members:
        optimizer.zero_grad()
        x, y = collate([sample(i) for i in members])
        (row_loss_sum(model(x), y) / x.shape[0]).backward()
        clip_like_deepspeed(model, clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class _Lines(logging.Handler):

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def straggler_timeline(stage, sleep_s: float, counts=(1, 1), metrics=True, steps=2, log_interval=0):
    """Rank 1 sleeps in each forward; every rank returns its last step report (no events) and the
    metrics lines DeepSpeed's logger printed."""
    rank = tdist.get_rank()
    captured = _Lines()
    deepspeed.utils.logger.addHandler(captured)
    zero = {"odc": {"metrics": metrics, "metrics_log_interval": log_interval}} if stage == "odc" else {}
    config = ds_config(stage, managed=False, **zero)
    if log_interval:
        config["log_level"] = "info"  # DeepSpeed's logger shows info lines only when asked to
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    if stage != "odc":
        ds_odc.metrics.attach(engine)
    if rank == 1:
        engine.module.blocks[0].register_forward_pre_hook(lambda *_: time.sleep(sleep_s))
    for step in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index)
            engine.backward(mse_mean(engine(x), y))
        engine.step()
    recorder = engine.odc_metrics
    report = None if recorder is None else recorder.last.without_events()
    reports_kept = 0 if recorder is None else len(recorder.reports)
    engine.destroy()
    deepspeed.utils.logger.removeHandler(captured)
    return {"report": report, "steps_recorded": reports_kept,
            "log_lines": [line for line in captured.lines if line.startswith("odc metrics:")]}
