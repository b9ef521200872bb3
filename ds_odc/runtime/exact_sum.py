"""Order-independent gradient sums: what ``deterministic`` accumulation adds, and why it is exact.

[Note: exact sums] Owners' accumulators sum pushes in the order they arrive, and ranks run at their own pace,
so with fp32 (or fp64) accumulators two runs of one job may round differently in the last bits. Floating-point
addition is order-independent exactly when every partial sum is representable, so a deterministic accumulator
makes every addend, and every partial sum, representable:

* each pushed value ``v`` (already divided by the world size) is cut in two fp64 parts on the pusher:
  ``coarse = round(v * 2**COARSE_BITS) / 2**COARSE_BITS`` and ``fine = round((v - coarse) * 2**FINE_BITS) /
  2**FINE_BITS``. Both cuts are elementwise and deterministic; ``v - coarse`` is exact in fp64.
* the two parts go into two fp64 regions of the owner's accumulator (the coarse one is the accumulator ZeRO-3
  reads). Every coarse addend is a multiple of ``2**-COARSE_BITS``: their sums are exact while
  ``|sum| < 2**(52 - COARSE_BITS)`` (:data:`COARSE_LIMIT`). Every fine addend is a multiple of
  ``2**-FINE_BITS`` and below ``2**-(COARSE_BITS + 1)`` in magnitude: their sums are exact for at least
  :data:`FINE_ADDENDS` pushes per element and step. Exact sums do not depend on the order of the additions,
  on the pusher's side nor on the owner's, nor in a reduce-scatter across nodes.
* at the step's fence (after every push has landed) the owner adds the fine region into the coarse one, once:
  a rounding of an order-independent value, the same in every run.

What it costs: 16 bytes of accumulator per shard element (fp32: 4, fp64: 8), two pushes per piece and a few
elementwise operations on the pusher. What it changes: a value's part below ``2**-FINE_BITS`` (about 8.7e-19)
is rounded away; an element whose sum over a step is below about 1e-11 keeps fewer than fp32's 24 significant
bits. A value or a sum beyond :data:`COARSE_LIMIT` (about 4.3e9; a gradient that large is a diverging run) is
still summed, then no longer exactly: :func:`beyond_exact_range` lets the caller say so.

Worked example (the third value alone would be lost in fp32 next to the first two, in some orders only):

>>> import torch
>>> values = torch.tensor([3.0e-3, -2.9999e-3, 7.1e-14, 1.0], dtype=torch.float32)
>>> coarse, fine = split(values)
>>> bool(((coarse + fine) - values.double()).abs().max() < 2.0 ** -FINE_BITS)
True
>>> orders = [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]]
>>> sums = {float(coarse[o].sum() + fine[o].sum()) for o in map(torch.tensor, orders)}
>>> len(sums)
1
"""
from __future__ import annotations

import torch

#: The coarse grid: multiples of 2**-COARSE_BITS.
COARSE_BITS = 20
#: The fine grid: multiples of 2**-FINE_BITS.
FINE_BITS = 60
#: Coarse sums are exact below this magnitude (fp64 holds 53 significant bits).
COARSE_LIMIT = 2.0 ** (52 - COARSE_BITS)
#: Fine sums stay exact for at least this many addends per element (each below 2**-(COARSE_BITS + 1)).
FINE_ADDENDS = 2 ** (52 - FINE_BITS + COARSE_BITS + 1)


def split(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(coarse, fine)``, two fp64 tensors on the grids above whose sum is ``values`` to ``2**-FINE_BITS``."""
    wide = values.detach().to(torch.float64)
    coarse = torch.round(wide * 2.0 ** COARSE_BITS).mul_(2.0 ** -COARSE_BITS)
    fine = (wide - coarse).mul_(2.0 ** FINE_BITS).round_().mul_(2.0 ** -FINE_BITS)
    return coarse, fine


def beyond_exact_range(coarse: torch.Tensor) -> bool:
    """Whether a coarse part reaches half the exact range (its sums may then round, order-dependently)."""
    return coarse.numel() > 0 and float(coarse.abs().max()) >= COARSE_LIMIT / 2


def combine(coarse: torch.Tensor, fine: torch.Tensor) -> None:
    """Add the fine region into the coarse one and clear it: once per fence, when every push has landed."""
    coarse.add_(fine)
    fine.zero_()
