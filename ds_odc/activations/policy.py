"""How much of one micro-batch's saved activations goes to the host: a pure function of its token count.

ODC runs one micro-batch at a time, so a rank's activation peak is its longest micro-batch's. The
profile (:class:`SavedProfile`, measured once per model by :mod:`ds_odc.activations.calibrate`) lists
the bytes per token of every saved tensor in the order the forward saves them. A micro-batch of ``t``
tokens is estimated to save ``t × bytes_per_token`` bytes; if that fits the budget nothing moves,
otherwise the *first* offloadable tensors (the first layers': saved earliest, used last in backward,
so alive longest) go to the host until what stays fits. The decision is a count of tensors, so the
bytes the hooks move equal the bytes planned whenever the model saves the same tensors as when it
was calibrated (sizes linear in tokens).

>>> profile = SavedProfile(offloadable=(4.0, 4.0, 2.0), kept=1.0)   # bytes per token
>>> decide(10, profile, budget_bytes=100)           # 110 bytes: 40 must move, the first tensor does it
OffloadDecision(tokens=10, saved_bytes=110, tensors=1, offload_bytes=40)
>>> decide(10, profile, budget_bytes=200).tensors   # fits: untouched
0
>>> decide(10, profile, budget_bytes=0)             # everything offloadable; 10 bytes are not
OffloadDecision(tokens=10, saved_bytes=110, tensors=3, offload_bytes=100)
>>> tokens_that_fit(profile, budget_bytes=100)      # with offload, only the kept 1 byte/token counts
100
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from ds_odc.errors import ODCError

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class SavedProfile:
    """Bytes per token of each offloadable saved tensor, in save order, and of the saved bytes that may not
    move (tensors the mode excludes; parameters are not activations and are in neither)."""

    offloadable: tuple[float, ...]
    kept: float = 0.0

    @property
    def bytes_per_token(self) -> float:
        return sum(self.offloadable) + self.kept

    def sizes(self, tokens: int) -> list[int]:
        """Each offloadable tensor's bytes at ``tokens`` (rounded to whole bytes)."""
        return [int(round(per_token * tokens)) for per_token in self.offloadable]


@dataclasses.dataclass(frozen=True)
class OffloadDecision:
    """One micro-batch: its tokens, its estimated saved bytes, and the first ``tensors`` offloadable saved
    tensors (``offload_bytes`` in all) that go to the host. ``tensors == 0``: left alone."""

    tokens: int
    saved_bytes: int
    tensors: int
    offload_bytes: int

    @property
    def offloads(self) -> bool:
        return self.tensors > 0


def decide(tokens: int, profile: SavedProfile, budget_bytes: float) -> OffloadDecision:
    """The fewest first tensors whose offload brings the micro-batch under ``budget_bytes`` (all of them when
    even that does not reach it: the rest cannot move)."""
    if tokens < 0 or budget_bytes < 0:
        raise ODCError(f"activation offload: tokens ({tokens}) and budget ({budget_bytes}) must be >= 0")
    sizes = profile.sizes(tokens)
    saved = sum(sizes) + int(round(profile.kept * tokens))
    excess, moved, count = saved - budget_bytes, 0, 0
    while moved < excess and count < len(sizes):
        moved += sizes[count]
        count += 1
    return OffloadDecision(tokens, saved, count, moved)


def tokens_that_fit(profile: SavedProfile, budget_bytes: float, offload: bool = True) -> Optional[int]:
    """The longest micro-batch (tokens) whose activations kept on the device fit ``budget_bytes``: with
    offload only the bytes that cannot move count, so ``token_cap`` may be raised to this; None when nothing
    stays on the device (the budget no longer bounds the cap: the host pool does)."""
    per_token = profile.kept if offload else profile.bytes_per_token
    if per_token <= 0:
        return None
    return int(math.floor(budget_bytes / per_token))


def plan_offload(tokens_per_micro_batch: Sequence[int], profile: SavedProfile,
                 budget_bytes: float) -> list[OffloadDecision]:
    """A rank's decisions for its planned micro-batches (what LB-Mini's plan implies), in order."""
    return [decide(tokens, profile, budget_bytes) for tokens in tokens_per_micro_batch]


def pool_bytes(decisions: Sequence[OffloadDecision]) -> int:
    """The host pool a sequence of micro-batches needs: the largest single offload, not the sum (ODC runs
    one micro-batch's forward and backward before the next forward)."""
    return max((decision.offload_bytes for decision in decisions), default=0)
