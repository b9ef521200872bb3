"""The ODC runtime: pull, push, and the step protocol, on top of any :class:`Transport`.

It knows parameters only as keys into a :class:`WindowLayout`; it knows nothing of DeepSpeed
(``ds_odc.integration`` adapts ZeRO-3 to it) nor of which transport it drives.

Phases of one optimizer step (an explicit state machine that tests assert)::

    IDLE --push--> ACCUMULATING --fence--> STEP --publish--> IDLE

Step protocol, three rendezvous rounds whatever the model or the number of micro-batches:

1. **fence**: every rank has finished its pushes (they are synchronous) and contributes its
   micro-batch and token counts; afterwards each owner's accumulator holds the complete sum;
2. **norm**: owners contribute the squared norms of their normalised shards (one global norm);
3. **publish**: owners have written their updated shards into their parameter windows and zeroed
   their accumulators; after this round peers may pull and push again.
"""
from __future__ import annotations

import enum
from typing import Sequence

import torch

from ds_odc.comm.transport import Transport
from ds_odc.runtime.layout import WindowLayout, owner_slices
from ds_odc.runtime.ledger import FENCE_WIDTH, MicroBatchLedger, StepTotals


class Phase(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    STEP = "step"


class ODCRuntime:
    """Pull / push / step for one data-parallel group."""

    def __init__(self, transport: Transport, layout: WindowLayout, ledger: MicroBatchLedger):
        self.transport = transport
        self.layout = layout
        self.ledger = ledger
        self.world_size = transport.world_size
        self.phase = Phase.IDLE
        self.pulls = 0  # parameters pulled, for tests and metrics
        self.pushes = 0  # gradients pushed
        self.last_totals: StepTotals | None = None

    @staticmethod
    def exchange_width(num_norm_groups: int) -> int:
        return max(FENCE_WIDTH, num_norm_groups) + 2

    # -- forward / backward: one-sided, no peer takes part -----------------------------------------
    def pull(self, key: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` (flat, ``numel`` elements, compute dtype) with the full parameter ``key``,
        reading each owner's shard from its window."""
        if self.phase is Phase.STEP:
            raise RuntimeError("pull during the optimizer step: owners are rewriting their shards")
        slot = self.layout.slots[key]
        for owner, start, count in owner_slices(slot.numel, slot.shard_numel, self.world_size):
            self.transport.read(owner, slot.param_offset, out.narrow(0, start, count))
        self.pulls += 1
        self.transport.heartbeat()
        return out

    def push(self, key: int, grad: torch.Tensor) -> None:
        """Add the full flat gradient of parameter ``key`` into its owners' accumulators."""
        if self.phase is Phase.STEP:
            raise RuntimeError("push during the optimizer step: call backward before engine.step()")
        slot = self.layout.slots[key]
        if slot.grad_offset is None:
            raise RuntimeError(f"parameter {key} is frozen but produced a gradient")
        if grad.numel() != slot.numel:
            raise ValueError(f"gradient of parameter {key} has {grad.numel()} elements, expected {slot.numel}")
        for owner, start, count in owner_slices(slot.numel, slot.shard_numel, self.world_size):
            self.transport.accumulate(owner, slot.grad_offset, grad.narrow(0, start, count))
        self.pushes += 1
        self.transport.heartbeat()
        self.phase = Phase.ACCUMULATING

    # -- the step --------------------------------------------------------------------------------
    def fence(self) -> StepTotals:
        """Round 1: wait until every rank's pushes have landed; learn the global counts."""
        rows = self.transport.exchange(self.ledger.fence_vector(), "the step fence (engine.step)")
        self.ledger.reset()
        self.phase = Phase.STEP
        self.last_totals = MicroBatchLedger.totals(rows)
        return self.last_totals

    def normalise(self, divisor: float) -> torch.Tensor:
        """Divide this owner's accumulated gradient by ``divisor``; return the accumulator."""
        accumulator = self.transport.local_grad_accumulator()
        if divisor != 1.0:
            accumulator.div_(divisor)
        return accumulator

    def global_sum(self, values: Sequence[torch.Tensor] | torch.Tensor, what: str) -> torch.Tensor:
        """Round 2: element-wise sum of a small vector over ranks (float64)."""
        if not isinstance(values, torch.Tensor):
            values = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values])
        return self.transport.exchange(values.reshape(-1), what).sum(0)

    def sync_windows(self, what: str) -> None:
        """A rendezvous outside the step (every rank rewrote its own shards; e.g. a checkpoint load)."""
        self.transport.exchange(torch.zeros(1, dtype=torch.float64), what)

    def publish(self) -> None:
        """Round 3: this owner's new shard is in its window and its accumulator is clear."""
        self.transport.local_grad_accumulator().zero_()
        self.transport.exchange(torch.zeros(1, dtype=torch.float64), "publishing updated shards")
        self.phase = Phase.IDLE

    def close(self) -> None:
        self.transport.close()
