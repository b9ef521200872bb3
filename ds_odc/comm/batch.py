"""Batched transfers: what one call moves, and the handle that says when it has landed.

ZeRO-3 gathers a module's parameters together, so a pull of a module is many small reads (one per
owner per parameter). Issued one at a time, each pays the runtime's checks, a Python call into the
transport and, on a GPU, a copy or kernel launch of its own. :meth:`Transport.read_many` and
:meth:`Transport.accumulate_many` take all of them at once, so a transport can do them in one pass
(shm: one loop, one stripe lock per stripe touched instead of one per piece) or one launch (cuda_ipc's
intent), and return a :class:`Completion`, as FSDP2's ``Comm`` returns a ``Work``: the caller issues
the batch, does other work, and calls :meth:`Completion.wait` before it reads the results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Transfer:
    """One contiguous range of ``owner``'s window, starting at element ``offset``: the destination
    of a read (``tensor`` is filled) or the source of an accumulate (``tensor`` is added)."""

    owner: int
    offset: int
    tensor: torch.Tensor


class Completion:
    """Handle of a batched transfer. After :meth:`wait`, a read's destinations hold the values (for
    the host, or for work later queued on the caller's current CUDA stream) and an accumulate's
    sources may be reused; its sums are visible to the owner after the next fence, as for
    :meth:`Transport.accumulate`. This base class is a transfer that was complete when returned."""

    def wait(self) -> None:
        """Block (host) or order (the caller's current stream) until the transfer is complete."""

    def is_completed(self) -> bool:
        """Whether :meth:`wait` would return at once with nothing left to order."""
        return True


#: The handle of a transfer done eagerly, inside the call that issued it.
COMPLETED = Completion()
