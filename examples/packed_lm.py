"""A small causal LM over *packed* variable-length samples, plus LongAlign-like sequence lengths.

A micro-batch is one row of tokens holding several samples back to back, with ``cu_seqlens``
marking where each starts (what FlashAttention's varlen kernels take). Linear layers run over the
whole row; attention runs per sample, so a micro-batch costs ``Σ (a·s² + b·s)`` over its samples —
the cost model the balancers plan with.
"""
from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

# LongAlign-10k after tokenisation: mean ≈ 16.5K tokens, max 64K (cap 65,536). Offline, lengths come
# from a lognormal matched to that mean and clipped to that range (an assumption, not the dataset).
LONGALIGN_MEAN, LONGALIGN_MAX, LONGALIGN_MIN = 16_540, 65_536, 512


def longalign_like_lengths(count: int, scale: int = 32, seed: int = 0, sigma: float = 1.0) -> list[int]:
    """``count`` lengths from the LongAlign-like distribution, divided by ``scale`` (so 64K -> 2048 at 32)."""
    rng = random.Random(seed)
    mu = math.log(LONGALIGN_MEAN) - sigma ** 2 / 2
    lengths = [min(LONGALIGN_MAX, max(LONGALIGN_MIN, rng.lognormvariate(mu, sigma))) for _ in range(count)]
    return [max(1, round(length / scale)) for length in lengths]


class Block(torch.nn.Module):

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        total, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(total, 3, self.heads, dim // self.heads).unbind(1)
        outputs = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # each sample attends to itself only
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            outputs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        x = x + self.proj(torch.cat(outputs).reshape(total, dim))
        return x + self.mlp(self.norm2(x))


class PackedCausalLM(torch.nn.Module):

    def __init__(self, vocab: int = 256, dim: int = 128, heads: int = 4, layers: int = 4, max_len: int = 2048):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.head(self.norm(x))


def make_sample(index: int, length: int, vocab: int = 256) -> torch.Tensor:
    """``length + 1`` tokens counting up by a stride of 1-3 from a random start: learnable in-context."""
    gen = torch.Generator().manual_seed(index)
    start = int(torch.randint(0, vocab, (1,), generator=gen))
    stride = int(torch.randint(1, 4, (1,), generator=gen))
    return (start + stride * torch.arange(length + 1)) % vocab


def pack(samples: list[torch.Tensor]):
    """Inputs, targets, positions and ``cu_seqlens`` of one packed micro-batch."""
    inputs = torch.cat([s[:-1] for s in samples])
    targets = torch.cat([s[1:] for s in samples])
    positions = torch.cat([torch.arange(len(s) - 1) for s in samples])
    cu_seqlens = [0]
    for s in samples:
        cu_seqlens.append(cu_seqlens[-1] + len(s) - 1)
    return inputs, targets, positions, cu_seqlens


def to_device(batch, device):
    """The packed micro-batch's tensors on ``device`` (``cu_seqlens`` stays a list: it only slices)."""
    inputs, targets, positions, cu_seqlens = batch
    return inputs.to(device), targets.to(device), positions.to(device), cu_seqlens


def device_of(model) -> torch.device:
    """Where ``model`` computes: ``engine.device`` for a DeepSpeed engine, else its parameters' device."""
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def loss_sum(model, batch) -> torch.Tensor:
    """Summed token loss of one packed micro-batch, computed on the model's device (the data loader
    yields CPU tensors; on a GPU they are moved here)."""
    inputs, targets, positions, cu_seqlens = to_device(batch, device_of(model))
    logits = model(inputs, positions, cu_seqlens)
    return F.cross_entropy(logits.float(), targets, reduction="sum")
