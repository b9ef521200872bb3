"""Gradient reads between backward and step: what a reader is handed, and how its writes reach the step.

[Note: reads are snapshots] ZeRO-3's gradient partitions change only at the reader's own next backward: the
reduce-scatter needs every rank, the reader included. On ODC nothing stops a faster peer's next push, so a
gradient fence outside a step (``get_fp32_grad_partitions``, ``safe_get_*_grad``, ``safe_set_*_grad``, the norm
read outside a step, ``engine.allreduce_gradients()``) hands the reader a *copy* of its accumulator, taken after
every push before the fence has landed and before any later one can (the fence's second round), summed over
nodes and folded there (exact sums), never the live accumulator:

* the copy is what ZeRO-3's buffers point at until this rank's own next push, its step, a discard, its
  accumulator going away (``offload_states``), or the next read after any rank pushed: the moments ZeRO-3's
  partitions would change for the same reader;
* a write into the copy (``safe_set_*_grad``, ``safe_update_full_grad_vectorized``, or in place) is the
  difference between the copy and the copy as taken, added into the live accumulator through the push path
  (atomic against peers' pushes) when the copy ends, so that it is neither lost nor makes a peer's push lost;
* the live accumulator is never written by a read, so pushes after a read stay exact under ``deterministic``
  and the step's sum over nodes counts every push once;
* reads in a row with no push anywhere between them reuse the copy (one round, no copy): reading every
  parameter's gradient costs one copy, not one per parameter.

What it costs: nothing on a step that never reads (a ``None`` check per push and per step); a read takes one
round more than a fence, one copy of this rank's accumulator and one of its own block (the writes' base), both
freed when the copy ends.
"""
from __future__ import annotations

from typing import Optional

import torch


class GradientSnapshot:
    """This rank's accumulator as a gradient read saw it. ``copy`` has the accumulator's layout (every region and
    block: ZeRO-3's views are the same offsets into it); ``own`` is ``(offset, numel)`` of this rank's trainable
    block, the part a reader may write; ``regions`` is 2 under exact sums (writes go in as two exact parts).

    >>> accumulator = torch.tensor([1.0, 2.0, 3.0, 4.0])
    >>> snapshot = GradientSnapshot(accumulator.clone(), own=(1, 2))
    >>> snapshot.copy[2] = 5.0          # a reader's write
    >>> snapshot.writes()
    tensor([0., 2.], dtype=torch.float64)
    >>> GradientSnapshot(accumulator.clone(), own=(1, 2)).writes() is None
    True
    """

    def __init__(self, copy: torch.Tensor, own: tuple[int, int]):
        self.copy = copy
        self.own = own
        self.taken = copy.narrow(0, *own).clone()  # the writes are what differs from this

    def writes(self) -> Optional[torch.Tensor]:
        """What readers wrote into this rank's block since the copy was taken, as a difference to add (None:
        nothing). An element left as it was adds nothing, also where it is not finite; a write over a value that
        is not finite cannot be told from later pushes by a difference, and leaves the step's value not finite
        (the step is then skipped, as for any non-finite gradient: never a silent number)."""
        now = self.copy.narrow(0, *self.own)
        changed = now.ne(self.taken) & ~(now.isnan() & self.taken.isnan())
        if not bool(changed.any()):
            return None
        # in fp64: the accumulator's add then gives back exactly the value written where no push came since
        wide = now.to(torch.float64) - self.taken.to(torch.float64)
        return torch.where(changed, wide, torch.zeros((), dtype=torch.float64, device=wide.device))
