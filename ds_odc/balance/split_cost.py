"""What one sample costs each member of a Ulysses group it is split over: its compute divided by the
group, plus the all-to-alls the split adds.

Ulysses sequence parallelism over a group of ``p`` ranks gives every member ``s / p`` of the sample's
tokens for everything outside attention, and ``1 / p`` of the attention heads over the whole sequence
inside it. So both terms of a sample's cost divide by the group:

    member cost = per_micro_batch + (quadratic·s² + linear·s) / p + all_to_all(s, p)

The all-to-alls swap the sequence split for the head split before attention and back after it, for
q, k, v and the output, in forward and in backward: per layer ``all_to_alls_per_layer`` of them, each
moving the member's ``s / p`` tokens × ``bytes_per_token`` of which ``(p - 1) / p`` leaves the rank.
They sit on the critical path (attention waits for them), so the model adds them to compute:

    all_to_all(s, p) = layers · all_to_alls_per_layer · (latency + bytes_per_token · s · (p-1) / p² / bandwidth)

Everything is in the cost model's unit: with a cost model in seconds (fitted on the machine, or the
paper's fit read as seconds, as the simulator does) ``latency`` is seconds and ``bandwidth`` bytes per
second. :func:`fit_all_to_all` measures both on the machine that trains, as
:func:`~ds_odc.balance.cost.fit_cost_model` measures compute.

>>> a2a = AllToAllCost()  # the documented defaults: the 1.5B model inside an A100 node
>>> round(a2a.seconds(65536, 8), 4), a2a.seconds(65536, 1)  # a 64K sample over 8 ranks; whole: none
(0.0447, 0.0)
>>> golden = CostModel.quadratic_linear(1.982122, 2.611821, length_unit=32000)
>>> split = SplitCostModel(golden, a2a)
>>> round(split.whole([65536]), 2), round(split.member(65536, 8), 3)  # 13.66 s whole, 1.752 s per member
(13.66, 1.752)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from ds_odc.arguments import require_whole_number
from ds_odc.balance.cost import CostModel, median_time, nonnegative_least_squares
from ds_odc.errors import ODCError

#: Where the defaults of :class:`AllToAllCost` come from (the simulator's golden setting,
#: ``benchmarks/sim/presets.py``).
DEFAULT_SOURCES = {
    "layers": "28: DeepSeek-R1-Distill-Qwen-1.5B, the model of the paper's 1.5B cost fit",
    "all_to_alls_per_layer": "8: q, k, v and the output, forward and backward (ALST's Ulysses); activation "
                             "checkpointing repeats the forward four in the recompute: 12",
    "bytes_per_token": "3072: hidden 1536 in bf16, for each of the four; conservative under GQA (the 1.5B model's "
                       "k and v have 2 of 12 heads, so its real average is 0.58 of this)",
    "bandwidth": "130e9 bytes/s per rank: inside an NVSwitch A100 node, the simulator's intra-node link (the "
                 "paper finds point-to-point and NCCL comparable there)",
    "latency": "30e-6 s per all-to-all: the simulator's collective latency inside a node",
}


@dataclasses.dataclass(frozen=True)
class AllToAllCost:
    """Ulysses' all-to-alls of one split sample, per member (see the module docstring; the defaults and
    where each comes from: :data:`DEFAULT_SOURCES`). Measure your own with :func:`fit_all_to_all`."""

    layers: int = 28
    all_to_alls_per_layer: int = 8
    bytes_per_token: float = 2.0 * 1536
    bandwidth: float = 130e9
    latency: float = 30e-6

    def __post_init__(self):
        for name in ("layers", "all_to_alls_per_layer"):
            require_whole_number(f"AllToAllCost.{name}", getattr(self, name), 0)
        if not self.bytes_per_token >= 0:
            raise ODCError(f"AllToAllCost.bytes_per_token must be >= 0, got {self.bytes_per_token}")
        if not self.bandwidth > 0:
            raise ODCError(f"AllToAllCost.bandwidth must be > 0 bytes per cost unit, got {self.bandwidth}")
        if not self.latency >= 0:
            raise ODCError(f"AllToAllCost.latency must be >= 0, got {self.latency}")

    @classmethod
    def free(cls) -> "AllToAllCost":
        """No communication cost: splitting only divides compute (a bound, and handy in examples)."""
        return cls(layers=0)

    def per_all_to_all(self, tokens: int, group_size: int) -> float:
        """One all-to-all of a ``tokens``-long sample over ``group_size`` ranks, per member."""
        p = group_size
        return self.latency + self.bytes_per_token * tokens * (p - 1) / (p * p) / self.bandwidth

    def seconds(self, tokens: int, group_size: int) -> float:
        """Every all-to-all of one forward and backward of the sample, per member (0 when whole)."""
        if group_size < 1:
            raise ODCError(f"group size must be >= 1, got {group_size}")
        if group_size == 1:
            return 0.0
        return self.layers * self.all_to_alls_per_layer * self.per_all_to_all(tokens, group_size)


@dataclasses.dataclass(frozen=True)
class SplitCostModel:
    """A whole micro-batch's cost (``compute``) and a split sample's cost to each member of its group."""

    compute: CostModel
    all_to_all: AllToAllCost = AllToAllCost()

    def whole(self, lengths: Sequence[int]) -> float:
        """A packed micro-batch run by one rank: ``per_micro_batch + Σ sample cost``."""
        return self.compute.micro_batch_cost(lengths)

    def member(self, length: int, group_size: int) -> float:
        """One sample split over ``group_size`` ranks, as one micro-batch on each: what each member pays."""
        return self.member_batch([length], group_size)

    def member_batch(self, lengths: Sequence[int], group_size: int) -> float:
        """A packed micro-batch of these samples split over ``group_size`` ranks (each member holds ``1/p``
        of the packed tokens; attention stays per sample): every sample's compute divided by the group, and
        one set of all-to-alls over all the tokens (their latencies once, not once per sample).

        >>> split = SplitCostModel(CostModel.tokens(), AllToAllCost(layers=1, all_to_alls_per_layer=1,
        ...                                                         bytes_per_token=4.0, bandwidth=1.0, latency=5.0))
        >>> split.member_batch([100, 300], 2)  # 400 / 2 compute + 5 latency + 4 B x 400 tokens x (2-1) / 2² bytes
        605.0
        """
        if group_size < 1:
            raise ODCError(f"group size must be >= 1, got {group_size}")
        return (self.compute.per_micro_batch + sum(self.compute.sample_costs(lengths)) / group_size
                + self.all_to_all.seconds(sum(lengths), group_size))

    def fixed_group_model(self, group_size: int) -> CostModel:
        """The same prices as one :class:`CostModel` per member of a fixed group (every sample split, packed:
        fixed SP): ``member_batch(lengths, p) == fixed_group_model(p).micro_batch_cost(lengths)``.

        >>> split = SplitCostModel(CostModel(quadratic=2.0, linear=2.0), AllToAllCost.free())
        >>> split.fixed_group_model(2)
        CostModel(quadratic=1.0, linear=1.0, per_micro_batch=0.0)
        """
        a2a, p = self.all_to_all, group_size
        if p < 1:
            raise ODCError(f"group size must be >= 1, got {p}")
        count = a2a.layers * a2a.all_to_alls_per_layer if p > 1 else 0
        per_token = count * a2a.bytes_per_token * (p - 1) / (p * p) / a2a.bandwidth
        return CostModel(quadratic=self.compute.quadratic / p, linear=self.compute.linear / p + per_token,
                         per_micro_batch=self.compute.per_micro_batch + count * a2a.latency)


def fit_all_to_all(measure: Callable[[int], float], tokens: Sequence[int], group_size: int, repeats: int = 3,
                   warmup: int = 1, **shape) -> AllToAllCost:
    """Fit ``latency`` and ``bandwidth`` to measured all-to-alls, as :func:`~ds_odc.balance.cost.fit_cost_model`
    fits compute: ``measure(n)`` runs *one* all-to-all over a group of ``group_size`` ranks in which each
    member holds ``n / group_size`` tokens × ``bytes_per_token`` bytes, and returns its seconds
    (:func:`~ds_odc.balance.cost.forward_backward_timer` wraps such a call). The median of ``repeats``
    runs after ``warmup`` discarded ones is fitted, by non-negative least squares, to
    ``latency + bytes moved / bandwidth``. ``shape`` sets the other fields (``layers``,
    ``all_to_alls_per_layer``, ``bytes_per_token``) of the result.

    >>> truth = AllToAllCost(bandwidth=2e9, latency=1e-3)
    >>> fitted = fit_all_to_all(lambda n: truth.per_all_to_all(n, 2), [1024, 4096, 16384], group_size=2)
    >>> round(fitted.bandwidth / 1e9, 3), round(fitted.latency * 1e3, 3)
    (2.0, 1.0)
    """
    if group_size < 2:
        raise ODCError(f"fit_all_to_all needs a group of >= 2 ranks, got {group_size}")
    counts = sorted({int(n) for n in tokens})
    if len(counts) < 2 or counts[0] < 1:
        raise ODCError(f"fit_all_to_all needs at least 2 distinct token counts >= 1, got {list(tokens)}")
    template = AllToAllCost(**shape)
    moved = [template.bytes_per_token * n * (group_size - 1) / (group_size * group_size) for n in counts]
    times = [median_time(measure, n, repeats, warmup) for n in counts]
    latency, per_byte = nonnegative_least_squares([[1.0, b] for b in moved], times)
    if per_byte <= 0 or not math.isfinite(per_byte):
        raise ODCError(f"fit_all_to_all: measured times {times} do not grow with the bytes moved {moved}; "
                       "measure larger token counts")
    return dataclasses.replace(template, latency=latency, bandwidth=1.0 / per_byte)
