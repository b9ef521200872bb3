"""Cost models: how long one sample, and one micro-batch, takes to run forward and backward.

A balancer is only as good as its idea of cost. Token count is the classic proxy, but attention makes
a sample's cost grow with the square of its length, so long samples cost more than their tokens say.
The models here are all of the form

    cost(micro-batch) = per_micro_batch + sum over its samples s of (quadratic * s**2 + linear * s)

which is exact for packed variable-length attention (each sample attends only to itself) and covers
the fixed cost of a micro-batch (kernel launches, parameter gathers) with one constant.

>>> CostModel.tokens().micro_batch_cost([3, 5])
8.0
>>> CostModel(quadratic=1.0, linear=2.0, per_micro_batch=10.0).micro_batch_cost([3, 5])
60.0
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Sequence

from ds_odc.errors import ODCError


@dataclasses.dataclass(frozen=True)
class CostModel:
    """``per_micro_batch + Σ (quadratic·s² + linear·s)``, in whatever unit it was built in (seconds when fitted)."""

    quadratic: float = 0.0
    linear: float = 1.0
    per_micro_batch: float = 0.0

    def __post_init__(self):
        for name in ("quadratic", "linear", "per_micro_batch"):
            if getattr(self, name) < 0:
                raise ODCError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.quadratic == 0 and self.linear == 0:
            raise ODCError("CostModel needs a positive quadratic or linear term: every sample would cost 0")

    @classmethod
    def tokens(cls) -> "CostModel":
        """Cost = token count."""
        return cls(quadratic=0.0, linear=1.0)

    @classmethod
    def quadratic_linear(cls, a: float, b: float, length_unit: float = 1.0) -> "CostModel":
        """``a·x² + b·x`` with ``x = s / length_unit`` (a published fit is often given per 32K tokens)."""
        return cls(quadratic=a / length_unit ** 2, linear=b / length_unit)

    def sample_cost(self, length: int) -> float:
        return self.quadratic * length * length + self.linear * length

    def sample_costs(self, lengths: Sequence[int]) -> list[float]:
        q, lin = self.quadratic, self.linear
        return [q * s * s + lin * s for s in lengths]

    def micro_batch_cost(self, lengths: Sequence[int]) -> float:
        return self.per_micro_batch + sum(self.sample_costs(lengths))


def fit_cost_model(measure: Callable[[int], float], lengths: Sequence[int], repeats: int = 3,
                   warmup: int = 1) -> CostModel:
    """Fit ``c + a·s² + b·s`` (all coefficients >= 0) to measured times of single-sample micro-batches.

    ``measure(length)`` runs one micro-batch of one sample of that length and returns its seconds; the
    median of ``repeats`` runs (after ``warmup`` discarded ones) is fitted by non-negative least squares.
    Call it once on the machine that trains; see :func:`forward_backward_timer`.
    """
    lengths = sorted(set(int(s) for s in lengths))
    if len(lengths) < 3:
        raise ODCError(f"fit_cost_model needs at least 3 distinct lengths to fit 3 coefficients, got {lengths}")
    if lengths[0] < 1:
        raise ODCError(f"fit_cost_model: lengths must be >= 1, got {lengths[0]}")
    times = [median_time(measure, length, repeats, warmup) for length in lengths]
    per_micro_batch, quadratic, linear = nonnegative_least_squares(
        [[1.0, float(s) ** 2, float(s)] for s in lengths], times)
    if quadratic == 0 and linear == 0:
        raise ODCError(f"fit_cost_model: measured times {times} do not grow with length {lengths}; "
                       "measure longer samples")
    return CostModel(quadratic=quadratic, linear=linear, per_micro_batch=per_micro_batch)


def median_time(measure: Callable[[int], float], size: int, repeats: int, warmup: int) -> float:
    """The median of ``repeats`` calls of ``measure(size)`` after ``warmup`` discarded ones: what each fit fits."""
    for _ in range(warmup):
        measure(size)
    samples = sorted(measure(size) for _ in range(max(1, repeats)))
    return samples[len(samples) // 2]


def forward_backward_timer(run_micro_batch: Callable[[int], None], synchronize: Callable[[], None] = lambda: None):
    """Wrap ``run_micro_batch(length)`` (forward + backward of one sample) into a ``measure`` for fitting."""

    def measure(length: int) -> float:
        synchronize()
        start = time.perf_counter()
        run_micro_batch(length)
        synchronize()
        return time.perf_counter() - start

    return measure


def nonnegative_least_squares(rows: list[list[float]], target: list[float]) -> list[float]:
    """Exact NNLS for a handful of columns: the best least-squares fit over every subset of columns
    whose solution is non-negative. Columns are rescaled first so s² does not swamp the solve."""
    import torch

    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(target, dtype=torch.float64).unsqueeze(1)
    scale = a.abs().max(dim=0).values.clamp_min(1e-300)
    a = a / scale
    columns = a.shape[1]
    best, best_error = [0.0] * columns, float(y.pow(2).sum())
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution = torch.linalg.lstsq(a[:, list(subset)], y, driver="gelsd").solution.squeeze(1)
            if (solution < 0).any():
                continue
            error = float((a[:, list(subset)] @ solution.unsqueeze(1) - y).pow(2).sum())
            if error < best_error - 1e-18:
                coefficients = [0.0] * columns
                for column, value in zip(subset, solution.tolist()):
                    coefficients[column] = value / float(scale[column])
                best, best_error = coefficients, error
    return best


@dataclasses.dataclass(frozen=True)
class OffloadTransfer:
    """Activation offload's copies of one micro-batch, and the part of their time compute cannot hide.

    A micro-batch of ``t`` tokens saves about ``t × bytes_per_token`` bytes; what exceeds ``budget_bytes``
    goes to the host during forward and comes back during backward, each way at ``bytes_per_second``.
    The copy out overlaps the forward (``forward_share`` of the micro-batch's compute), the copy back the
    backward (the rest); only what sticks out of each costs time. Long micro-batches hide best: attention
    compute grows with s², the bytes with s.

    >>> transfer = OffloadTransfer(bytes_per_token=10.0, budget_bytes=100.0, bytes_per_second=100.0)
    >>> transfer.offload_bytes(30), transfer.exposed_seconds(30, compute_seconds=1.5)  # 2 s each way
    (200.0, 2.5)
    >>> transfer.exposed_seconds(10, compute_seconds=0.1)  # fits the budget: nothing moves
    0.0
    """

    bytes_per_token: float
    budget_bytes: float
    bytes_per_second: float
    forward_share: float = 1.0 / 3.0

    def offload_bytes(self, tokens: int) -> float:
        return max(0.0, tokens * self.bytes_per_token - self.budget_bytes)

    def exposed_seconds(self, tokens: int, compute_seconds: float) -> float:
        copy = self.offload_bytes(tokens) / self.bytes_per_second
        forward = self.forward_share * compute_seconds
        return max(0.0, copy - forward) + max(0.0, copy - (compute_seconds - forward))


@dataclasses.dataclass(frozen=True)
class OffloadAwareCost(CostModel):
    """A cost model in seconds plus the offload transfer its micro-batches cannot hide (packed micro-batches:
    the plan's candidates are compared with it, so LB-Mini's balance holds with offload on).

    >>> base = CostModel(quadratic=0.0, linear=0.05)  # 30 tokens: 1.5 s
    >>> OffloadAwareCost.around(base, OffloadTransfer(10.0, 100.0, 100.0)).micro_batch_cost([30])
    4.0
    """

    transfer: OffloadTransfer | None = None

    @classmethod
    def around(cls, model: CostModel, transfer: OffloadTransfer) -> "OffloadAwareCost":
        return cls(model.quadratic, model.linear, model.per_micro_batch, transfer)

    def micro_batch_cost(self, lengths: Sequence[int]) -> float:
        compute = super().micro_batch_cost(lengths)
        if self.transfer is None:
            return compute
        return compute + self.transfer.exposed_seconds(sum(lengths), compute)
