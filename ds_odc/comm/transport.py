"""The transport boundary: one-sided windows plus the one step rendezvous.

The runtime sees only this interface. A transport owns, for every rank of the data-parallel group,

* a **parameter window** of ``param_numel`` elements in the compute dtype, which peers *read*
  (pull) without the owner taking part;
* a **gradient accumulator** of ``grad_numel`` fp32 (or fp64) elements, which peers *add into* (push)
  without the owner taking part, correctly under concurrent pushes;
* a **step rendezvous** (:meth:`Transport.exchange`), the single synchronisation point of an
  optimizer step: every rank contributes a small float vector and receives everyone's.

Allocation is separate from transfer (as in FSDP2's ``Comm``): :meth:`allocate` runs once per
engine, at initialisation, and may use collectives; nothing after it may.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WindowSpec:
    """Sizes of one rank's windows; identical on every rank (ZeRO-3's layout guarantees it)."""

    param_numel: int
    param_dtype: torch.dtype
    grad_numel: int
    exchange_width: int = 32
    grad_dtype: torch.dtype = torch.float32


class Transport(abc.ABC):
    """One-sided windows of a data-parallel group. See the module docstring for the contract."""

    name: str = "abstract"

    def __init__(self, rank: int, world_size: int, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.exchanges = 0  # step rendezvous rounds so far; tests count them

    @abc.abstractmethod
    def allocate(self, spec: WindowSpec) -> None:
        """Create this rank's windows and map every peer's. Collective; called once."""

    @abc.abstractmethod
    def local_param_window(self) -> torch.Tensor:
        """This rank's parameter window (its shards, compute dtype). Peers read it at any time
        except between the step's fence and its publish, so the owner writes it only then."""

    @abc.abstractmethod
    def local_grad_accumulator(self) -> torch.Tensor:
        """This rank's fp32 accumulator. Peers add into it until the step fence."""

    @abc.abstractmethod
    def read(self, owner: int, offset: int, out: torch.Tensor) -> None:
        """Copy ``out.numel()`` elements of ``owner``'s parameter window, from ``offset``, into ``out``."""

    @abc.abstractmethod
    def accumulate(self, owner: int, offset: int, grad: torch.Tensor) -> None:
        """Add ``grad`` (any float dtype) into ``owner``'s accumulator at ``offset``, in fp32.
        Returns once the addition is complete and visible to the owner after the next fence."""

    @abc.abstractmethod
    def exchange(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """The step rendezvous: contribute ``values`` (1-D, at most ``exchange_width``) and return a
        ``[world_size, len(values)]`` float64 tensor of every rank's contribution, row r from rank r.
        A dead peer, or one without a :meth:`heartbeat` for ``timeout_s``, raises
        :class:`~ds_odc.errors.ODCPeerError` naming it and ``what`` the rendezvous was for."""

    @abc.abstractmethod
    def heartbeat(self) -> None:
        """Tell peers waiting at a rendezvous that this rank is still making progress."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release windows, files and descriptors. Idempotent."""


def agree_on_session(rank: int, group=None) -> str:
    """A name every rank of ``group`` shares for this engine's segments (rank 0 draws it)."""
    import uuid

    import torch.distributed as tdist

    box = [uuid.uuid4().hex[:12] if rank == 0 else None]
    tdist.broadcast_object_list(box, src=tdist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]
