"""Windows away and back: what ``engine.offload_states()`` / ``reload_states()`` do to ODC's windows.

On ZeRO-3 those calls move a rank's own buffers between the device and host memory, and nothing else
notices. On ODC two of the buffers are windows the peers reach: the parameter window (DeepSpeed's
``lp_params``) and the gradient accumulator (``lp_grads``). Moving one is therefore done by the whole
node in rounds, which :class:`~ds_odc.runtime.step.StepProtocol` runs (``offload_windows``,
``reload_windows``)::

    away   round: every rank asks for the same windows; nobody pulls or pushes any more
           copy this rank's own windows into host memory; drop the mappings of peers' windows
           round: nobody maps a window that is about to be freed
           drop this rank's own windows
    back   make new windows and copy the host copies in (a failure is carried into the round)
           round: every rank brings back the same windows, and each new window exists and holds its
                  content; or every rank raises, naming the rank that could not allocate, and the
                  windows stay away (call reload_states again)
           map the peers' new windows
           (shm only) round: every rank mapped them; their files go

While a window is away, this rank's views of its own shards and gradients are views of the host copy
(:meth:`WindowStash.window`; the adapter points ZeRO-3's buffers there, as ZeRO-3's own offload does),
and a pull (parameters away), a push (gradients away), a step, or a round that reads a window refuses,
naming the call that brings them back. Content is copied, never recomputed: training after
``reload_states`` is bit for bit the training without the two calls.

What "away" frees: on a GPU the windows' device memory (after every peer closed its mapping), for a
rollout engine to use; on CPU the shared-memory pages in ``shm_dir`` (the host copy is ordinary
process memory). Both are the same path: only the transport's primitives differ.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, Optional

import torch

from ds_odc.comm.transport import Transport

#: The windows a rank can move: its parameter window and its gradient accumulator.
WINDOW_KINDS = ("params", "grads")
_WORDS = {"params": "parameter window", "grads": "gradient accumulator"}


def describe(kinds: Iterable[str]) -> str:
    """``{"params", "grads"}`` -> "parameter window and gradient accumulator"."""
    names = [_WORDS[k] for k in WINDOW_KINDS if k in set(kinds)]
    return " and ".join(names) if names else "no window"


def mask(kinds: Iterable[str]) -> float:
    """The kinds as a round value: bit i for ``WINDOW_KINDS[i]``."""
    kinds = set(kinds)
    return float(sum(1 << i for i, kind in enumerate(WINDOW_KINDS) if kind in kinds))


def kinds_of(value: float) -> FrozenSet[str]:
    return frozenset(kind for i, kind in enumerate(WINDOW_KINDS) if int(value) >> i & 1)


def disagreement(rows: torch.Tensor, columns: tuple, first_rank: int = 0) -> Optional[str]:
    """None when every rank's row (``[requested, away]`` masks) equals rank 0's; else which ranks differ and how."""
    reference = rows[0]
    differing = [r for r in range(rows.shape[0]) if not torch.equal(rows[r], reference)]
    if not differing:
        return None

    def said(r: int) -> str:
        return ", ".join(f"{name} {describe(kinds_of(rows[r][i].item()))}" for i, name in enumerate(columns))

    return "; ".join(f"rank {first_rank + r}: {said(r)}" for r in [0, *differing])


class WindowStash:
    """This rank's own windows: on the transport (mapped, peers reach them) or away in host memory."""

    def __init__(self, transport: Transport):
        self.transport = transport
        self.host: Dict[str, torch.Tensor] = {}

    @property
    def away(self) -> FrozenSet[str]:
        return frozenset(self.host)

    def window(self, kind: str) -> torch.Tensor:
        """This rank's window of ``kind``: its host copy while away, else the transport's."""
        if kind in self.host:
            return self.host[kind]
        return self.transport.local_param_window() if kind == "params" else self.transport.local_grad_accumulator()

    def take(self, kinds: Iterable[str], pin_memory: bool, non_blocking: bool) -> None:
        """Copy the windows of ``kinds`` into host memory (pinned when asked and the window is on a GPU;
        ``non_blocking``: the copy may still run; the next round waits for the device)."""
        for kind in kinds:
            window = self.window(kind)
            host = torch.empty(window.shape, dtype=window.dtype, device="cpu",
                               pin_memory=pin_memory and window.is_cuda)
            host.copy_(window, non_blocking=non_blocking and window.is_cuda)
            self.host[kind] = host

    def put_back(self, kinds: Iterable[str], non_blocking: bool) -> None:
        """Copy the host copies of ``kinds`` into the transport's new windows (the host copies stay until
        :meth:`release`: the windows are not back until every rank's are)."""
        for kind in kinds:
            target = self.transport.local_param_window() if kind == "params" \
                else self.transport.local_grad_accumulator()
            target.copy_(self.host[kind], non_blocking=non_blocking and target.is_cuda)

    def release(self, kinds: Iterable[str]) -> None:
        for kind in kinds:
            self.host.pop(kind, None)
