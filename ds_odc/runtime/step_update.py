"""What an engine adapter hands the step protocol (:class:`StepUpdate`: its norm inputs and the update itself) and
what it gets back (:class:`GlobalNorms`: the norm round's result). The contract between the protocol
(:mod:`ds_odc.runtime.step`), which owns the rounds, and the adapter, which owns the optimizer."""
from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GlobalNorms:
    """The norm round's result: per norm group, the squared L2 norm of the whole normalised gradient."""

    squared: torch.Tensor  # float64, one entry per norm group

    @property
    def finite(self) -> bool:
        return bool(torch.isfinite(self.squared).all())

    def group_norms(self) -> torch.Tensor:
        return self.squared.sqrt()

    def total(self) -> float:
        return float(self.squared.sum().sqrt())


class StepUpdate(abc.ABC):
    """What an engine adapter supplies to a step: the norm inputs and the update itself."""

    gradient_accumulation_steps: int = 1

    @abc.abstractmethod
    def squared_norms(self) -> torch.Tensor:
        """Per norm group, the squared L2 norm of this owner's *normalised* gradient shard (1-D;
        inf/nan allowed: the global result then says not finite)."""

    @abc.abstractmethod
    def apply(self, norms: GlobalNorms) -> None:
        """Write this owner's updated shards into its window (or skip the update: every rank gets
        the same ``norms``, so every rank decides the same)."""
