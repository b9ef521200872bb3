"""Micro-batch bookkeeping and the normalisation rule applied at the step.

Every backward on a rank records one micro-batch with the rule its caller asked for:

* ``MEAN``   ``engine.backward(loss)`` in managed mode (DeepSpeed would divide each loss by
             ``gradient_accumulation_steps``): the summed gradient is divided by the *global*
             number of micro-batches, i.e. the mean over all micro-batches of all ranks;
* ``CALLER`` the caller owns the scaling (``scale_wrt_gas=False``, unmanaged accumulation): the
             summed gradient is divided by the world size (on the way in: pushes are pre-divided),
             exactly as ZeRO-3's reduce-scatter does;
* ``TOKEN``  the micro-batch reported ``loss_tokens`` and its loss is a *sum* over those tokens:
             the summed gradient is divided by the global token count.

With equal counts on every rank, MEAN reproduces ZeRO-3's ``1 / (world * gas)``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ds_odc.errors import ODCPeerError


class LossNormalization(enum.IntEnum):
    MEAN = 0
    CALLER = 1
    TOKEN = 2


#: Layout of a rank's contribution to the fence: micro-batches per rule, loss tokens, then shared micro-batches.
FENCE_WIDTH = len(LossNormalization) + 2


@dataclass(frozen=True)
class StepTotals:
    """What the fence learned: global micro-batch counts per rule and the global token count."""

    micro_batches: tuple  # per LossNormalization
    tokens: int
    per_rank_micro_batches: tuple  # all rules together, one entry per rank
    #: micro-batches recorded by a member of a split micro-batch other than its first: the same samples as the
    #: first member's record, so counting samples leaves them out (the divisors do not: see TOKEN)
    shared_micro_batches: int = 0

    @property
    def total_micro_batches(self) -> int:
        return sum(self.micro_batches)

    def rule(self) -> LossNormalization | None:
        used = [rule for rule in LossNormalization if self.micro_batches[rule]]
        if len(used) > 1:
            raise ODCPeerError(
                "micro-batches of one optimizer step used different normalisation rules "
                f"({', '.join(r.name for r in used)}): mix of engine.backward(loss) and scale_wrt_gas=False "
                "or loss_tokens across ranks or micro-batches. Use one rule for every micro-batch of a step.")
        return used[0] if used else None

    def gradient_divisor(self, world_size: int, gas: int = 1) -> float:
        """The number each owner divides its accumulator by at the step. Accumulators hold ZeRO-3's
        gradient partitions: the sum of every pushed gradient divided by ``world_size``. MEAN
        gradients also arrive divided by ``gas`` (DeepSpeed's per-micro-batch scaling), so MEAN
        divides by ``global micro-batches / (gas * world_size)``: 1 with equal counts, ZeRO-3's own
        arithmetic. CALLER leaves ZeRO-3's average as it is; TOKEN makes it a per-token mean."""
        rule = self.rule()
        if rule is None:
            return 1.0  # no micro-batch anywhere: nothing was pushed
        if rule is LossNormalization.MEAN:
            return self.micro_batches[LossNormalization.MEAN] / (gas * world_size)
        if rule is LossNormalization.CALLER:
            return 1.0
        return max(self.tokens, 1) / world_size  # zero tokens everywhere: gradients are all zero


class MicroBatchLedger:
    """This rank's micro-batches since the last step."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.counts = [0] * len(LossNormalization)
        self.tokens = 0
        self.shared = 0

    def record(self, rule: LossNormalization, tokens: int = 0, shared: bool = False) -> None:
        """One backward; ``shared``: this rank ran it as a member of a split micro-batch other than the first
        (its samples are the first member's too)."""
        if tokens < 0:
            raise ValueError(f"loss_tokens must be >= 0, got {tokens}")
        self.counts[rule] += 1
        self.tokens += tokens
        self.shared += int(shared)

    @property
    def micro_batches(self) -> int:
        return sum(self.counts)

    def fence_vector(self) -> torch.Tensor:
        return torch.tensor(self.counts + [self.tokens, self.shared], dtype=torch.float64)

    @staticmethod
    def totals(rows: torch.Tensor) -> StepTotals:
        """Combine every rank's :meth:`fence_vector` (rows of the rendezvous result)."""
        summed = rows.sum(0)
        counts = tuple(int(round(x)) for x in summed[:len(LossNormalization)].tolist())
        per_rank = tuple(int(round(x)) for x in rows[:, :len(LossNormalization)].sum(1).tolist())
        tokens, shared = (int(round(x)) for x in summed[len(LossNormalization):len(LossNormalization) + 2].tolist())
        return StepTotals(counts, tokens, per_rank, shared)
