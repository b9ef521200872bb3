"""How the control plane's errors name rounds and activities: the words come from the protocol above.

The control blocks carry a round's kind and a rank's activity as numbers; only the step protocol
(``ds_odc.runtime.round_kinds``) knows what they mean. It hands a :class:`Wording` to the transport it
opens, so that a peer's error reads "rank 1 is at round 3 (the step fence (engine.step), step 2)"
rather than "round kind 1". Without one, errors print the numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _numbered_round(kind: int) -> str:
    return f"round kind {kind}"


def _numbered_activity(activity: int, step: int, count: int) -> str:
    return f"in activity {activity} (step {step}, {count} micro-batches)"


@dataclass(frozen=True)
class Wording:
    round_name: Callable[[int], str] = _numbered_round
    """The text of round kind ``kind`` (e.g. "the step fence (engine.step)")."""
    activity: Callable[[int, int, int], str] = _numbered_activity
    """What a rank in ``(activity, step, count)`` is doing (e.g. "running forward/backward of step 3")."""


NUMBERS = Wording()
