"""What the ranks run in the activation-offload tests: the same uneven training with offload off and on."""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as tdist
from torch.utils.checkpoint import checkpoint

from tests.support.workloads import GradProbe, Net, ds_config, full_params, micro_batch, mse_mean

#: Rows (tokens) of micro-batch ``index``: 2, 5, 8 — short ones fit a small budget, long ones do not.
ROWS = (2, 5, 8)


class CheckpointedNet(Net):
    """Net whose layers (all but the last) run under torch's reentrant activation checkpointing, so what
    autograd saves is each checkpoint's input plus the last layer's."""

    def forward(self, x):
        h = checkpoint(lambda t: torch.tanh(self.inp(t)), x, use_reentrant=True)
        for block in self.blocks:
            h = checkpoint(lambda t, b=block: torch.tanh(b(t)), h, use_reentrant=True)
        if self.frozen is not None:
            h = checkpoint(lambda t: t + torch.tanh(self.frozen(t)), h, use_reentrant=True)
        return self.out(h)


def _train(offload, counts, steps, checkpointed):
    rank = tdist.get_rank()
    odc = {"accumulator_dtype": "fp64"}  # sums independent of push arrival order: bit-comparable runs
    if offload is not None:
        odc["activation_offload"] = offload
    torch.manual_seed(1234)
    model = CheckpointedNet() if checkpointed else Net()
    engine, *_ = deepspeed.initialize(model=model, config=ds_config("odc", managed=False, odc=odc))
    probe = GradProbe(engine)
    record = {"losses": [], "grads": [], "params": []}
    for step in range(steps):
        for index in range(counts[rank]):
            x, y, _ = micro_batch(step, rank, index, size=ROWS[index % len(ROWS)])
            x.requires_grad_(checkpointed)  # reentrant checkpointing needs an input that requires grad
            loss = mse_mean(engine(x), y)
            engine.backward(loss)
            record["losses"].append(loss.item())
        engine.step()
        record["grads"].append(probe.full_grads())
        record["params"].append(full_params(engine))
    offloader = engine.odc_activation_offload
    if offloader is not None:
        record["profile"] = (offloader.profile.offloadable, offloader.profile.kept)
        record["history"] = [vars(stats).copy() for stats in offloader.history]
        record["pool"] = vars(offloader.pool.stats).copy()
        record["parameter_bytes"] = sum(p.ds_numel * 4 for p in engine.module.parameters())
    engine.destroy()
    return record


def train_offload_variants(variants, counts=(1, 3), steps=3, checkpointed=False):
    """One training per entry of ``variants`` (None: offload off; else the activation_offload block), in the
    same ranks, one after the other."""
    return [_train(offload, counts, steps, checkpointed) for offload in variants]


def cuda_offload_variants(variants, rows=(64, 4096), steps=2):
    """On the rank's GPU: an 8-layer MLP (activations dominate its memory) with offload off and on; losses,
    parameters, each micro-batch's peak memory above what was allocated before it, and the offload history."""
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for offload in variants:
        odc = {"accumulator_dtype": "fp64"}
        if offload is not None:
            odc["activation_offload"] = offload
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                      for _ in range(8)])
        engine, *_ = deepspeed.initialize(model=model, config=ds_config("odc", managed=False, odc=odc))
        record = {"losses": [], "peaks": []}
        for step in range(steps):
            for n in rows:
                x = torch.randn(n, 256, generator=torch.Generator().manual_seed(100 * step + n)).to(device)
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
                loss = engine(x).float().pow(2).mean()
                engine.backward(loss)
                torch.cuda.synchronize(device)
                record["peaks"].append(torch.cuda.max_memory_allocated(device) - before)
                record["losses"].append(loss.item())
            engine.step()
        record["params"] = {name: tensor.cpu() for name, tensor in full_params(engine).items()}
        if engine.odc_activation_offload is not None:
            record["history"] = [vars(stats).copy() for stats in engine.odc_activation_offload.history]
            record["pinned"] = engine.odc_activation_offload.pool.pin
        engine.destroy()
        results.append(record)
    return results
