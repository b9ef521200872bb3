"""Samples packed into one sequence attend each within itself.

Under the split policy (:mod:`ds_odc.integration.split_attention`) a packed micro-batch, whole or split (its
sequence gathered by Ulysses, which drops the mask the model built for a slice), runs its attention per sample:
a sample starts where ``position_ids`` restart at 0. A sample's attention then costs its own length squared
(transformers' sdpa would mask a packed micro-batch densely and compute its total length squared: 3.5x the time
for four ~1K samples on a CPU).
"""
from __future__ import annotations

from typing import Callable

import torch


def per_sample(core: Callable) -> Callable:
    """``core`` attention run on each sample of a packed sequence separately (a sample starts where
    ``position_ids`` restart at 0), so that packed samples do not attend to each other once the split
    micro-batch's sequence is gathered (Ulysses drops the mask the model built for a slice)."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        positions = kwargs.get("position_ids")
        if positions is None or positions.shape[0] != 1:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        starts = sorted({0, *(int(i) for i in torch.nonzero(positions[0] == 0).flatten().tolist())})
        if len(starts) == 1:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        bounds = [*starts, positions.shape[1]]
        outputs = []
        for a, b in zip(bounds, bounds[1:]):
            out, _ = core(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, *args,
                          **dict(kwargs, position_ids=positions[:, a:b]))
            outputs.append(out)
        return torch.cat(outputs, dim=1), None

    return attention


def is_packed(positions) -> bool:
    """Whether one sequence's ``position_ids`` restart after its first token (several samples packed)."""
    return positions is not None and positions.shape[0] == 1 and bool((positions[0, 1:] == 0).any())
