"""Train a small causal LM with the ODC stage on CPU ranks, with variable-length samples.

Each optimizer step takes a global minibatch of samples whose lengths are long-tailed, splits them
between the ranks by token count (so ranks run *different numbers* of micro-batches, one sample
each), and normalises the loss per token over the whole minibatch. Under ZeRO-3 this script would
hang; under ODC ranks only meet at the step.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/train_causal_lm.py
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_causal_lm.py

The only ODC-specific line in the config is ``"stage": "odc"``; the only ODC-specific call is
``engine.backward(loss_sum, loss_tokens=n)`` for per-token normalisation.
"""
import argparse
import json
import os
import time

import deepspeed
import torch
import torch.nn.functional as F
from deepspeed import comm as dist

import ds_odc  # noqa: F401  registers the "odc" stage


class Block(torch.nn.Module):

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(torch.nn.Module):

    def __init__(self, vocab=128, dim=64, heads=4, layers=3, max_len=512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def sample_minibatch(step, size, vocab, max_len):
    """Long-tailed lengths; each sequence counts up by a stride of 1, 2 or 3 (learnable in-context)."""
    gen = torch.Generator().manual_seed(step)
    lengths = (torch.distributions.LogNormal(3.5, 0.8).sample((size,)).clamp(8, max_len)).long().tolist()
    samples = []
    for length in lengths:
        start = int(torch.randint(0, vocab, (1,), generator=gen))
        stride = int(torch.randint(1, 4, (1,), generator=gen))
        samples.append((start + stride * torch.arange(length + 1)) % vocab)
    return samples


def split_by_tokens(samples, world):
    """Greedy longest-first split of samples between ranks by token count."""
    loads, shares = [0] * world, [[] for _ in range(world)]
    for index in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        rank = loads.index(min(loads))
        shares[rank].append(samples[index])
        loads[rank] += len(samples[index])
    return shares


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", default=os.path.join(os.path.dirname(__file__), "ds_config_odc.json"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples_per_step", type=int, default=8)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyCausalLM()
    with open(args.deepspeed_config) as config_file:
        config = json.load(config_file)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"engine: {type(engine).__name__}, zero stage {engine.zero_optimization_stage()}, {world} ranks")

    progress = range(args.steps)
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(progress, desc="training", unit="step")
    for step in progress:
        start = time.perf_counter()
        mine = split_by_tokens(sample_minibatch(step, args.samples_per_step, 128, 512), world)[rank]
        loss_sum, tokens = 0.0, 0
        for sequence in mine:  # a different number of micro-batches on each rank
            inputs, targets = sequence[:-1].unsqueeze(0), sequence[1:].unsqueeze(0)
            logits = engine(inputs)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1), reduction="sum")
            engine.backward(loss, loss_tokens=targets.numel())
            loss_sum, tokens = loss_sum + loss.item(), tokens + targets.numel()
        compute_s = time.perf_counter() - start
        engine.step()
        totals = torch.tensor([loss_sum, float(tokens)])
        dist.all_reduce(totals)  # for the log line only
        if rank == 0:
            progress.set_postfix(loss=f"{totals[0] / totals[1]:.3f}")
            progress.write(f"step {step:3d} | loss/token {totals[0] / totals[1]:.4f} | micro-batches per rank "
                           f"{list(engine.odc_last_step.per_rank_micro_batches)} | rank-0 compute {compute_s:.2f}s")
    engine.destroy()


if __name__ == "__main__":
    main()
