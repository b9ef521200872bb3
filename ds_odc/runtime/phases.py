"""The step protocol's state machine: its phases, the events that move it, and every transition allowed.

One table (:data:`TRANSITIONS`) is the whole machine, driven by :class:`~ds_odc.runtime.step.StepProtocol`::

    IDLE --pull--> IDLE            ACCUMULATING --pull/push--> ACCUMULATING
    IDLE --push--> ACCUMULATING
    IDLE | ACCUMULATING --begin_step--> FENCING --fenced--> NORMING --normed--> UPDATING
        --updated--> PUBLISHING --published--> IDLE
    IDLE | ACCUMULATING --meet--> (unchanged)        a round outside a step (windows rewritten, barrier,
                                                     gradient fence)
    IDLE | ACCUMULATING --discard--> IDLE            optimizer.zero_grad outside a step
    any --fail--> FAILED (final)   any --close--> CLOSED (final)

:class:`StepStateMachine` refuses anything not in it, naming the event, the phase and a hint. Tests assert
phases through it; nothing else changes a phase.
"""
from __future__ import annotations

import enum

from ds_odc.errors import ODCStateError
from ds_odc.runtime.round_kinds import RoundKind


class Phase(enum.Enum):
    IDLE = "idle"
    ACCUMULATING = "accumulating"
    FENCING = "fencing"
    NORMING = "norming"
    UPDATING = "updating"
    PUBLISHING = "publishing"
    FAILED = "failed"
    CLOSED = "closed"


class Event(enum.Enum):
    PULL = "a parameter pull"
    PUSH = "a gradient push"
    BEGIN_STEP = "an optimizer step"
    FENCED = "the end of the step fence"
    NORMED = "the end of the gradient-norm exchange"
    UPDATED = "the end of the optimizer update"
    PUBLISHED = "the end of publishing"
    MEET = "a rendezvous round outside a step"
    DISCARD = "discarding gradients outside a step"
    FAIL = "a failure"
    CLOSE = "closing"


TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (Phase.IDLE, Event.PULL): Phase.IDLE,
    (Phase.ACCUMULATING, Event.PULL): Phase.ACCUMULATING,
    (Phase.IDLE, Event.PUSH): Phase.ACCUMULATING,
    (Phase.ACCUMULATING, Event.PUSH): Phase.ACCUMULATING,
    (Phase.IDLE, Event.BEGIN_STEP): Phase.FENCING,
    (Phase.ACCUMULATING, Event.BEGIN_STEP): Phase.FENCING,
    (Phase.FENCING, Event.FENCED): Phase.NORMING,
    (Phase.NORMING, Event.NORMED): Phase.UPDATING,
    (Phase.UPDATING, Event.UPDATED): Phase.PUBLISHING,
    (Phase.PUBLISHING, Event.PUBLISHED): Phase.IDLE,
    (Phase.IDLE, Event.MEET): Phase.IDLE,
    (Phase.ACCUMULATING, Event.MEET): Phase.ACCUMULATING,
    (Phase.IDLE, Event.DISCARD): Phase.IDLE,
    (Phase.ACCUMULATING, Event.DISCARD): Phase.IDLE,
    **{(phase, Event.FAIL): Phase.FAILED for phase in Phase if phase is not Phase.CLOSED},
    **{(phase, Event.CLOSE): Phase.CLOSED for phase in Phase},
}

#: Where a failure in each phase happened, for the failure record.
WHERE = {Phase.FENCING: RoundKind.FENCE.text, Phase.NORMING: RoundKind.NORM.text,
          Phase.UPDATING: "the optimizer update", Phase.PUBLISHING: RoundKind.PUBLISH.text}

_HINTS = {
    Event.PULL: "the owners are rewriting their shards; forward only between optimizer steps",
    Event.PUSH: "gradients of this step were already fenced; call backward before engine.step()",
    Event.BEGIN_STEP: "a step is already in progress on this rank",
    Event.MEET: "rounds outside a step cannot run inside one",
    Event.DISCARD: "gradients cannot be discarded inside an optimizer step",
}


class StepStateMachine:
    """The phase of this rank's step protocol; every change goes through :data:`TRANSITIONS`."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE

    def advance(self, event: Event) -> Phase:
        following = TRANSITIONS.get((self.phase, event))
        if following is None:
            hint = _HINTS.get(event, "the step protocol's rounds must run in order")
            raise ODCStateError(f"{event.value} is not allowed in phase {self.phase.value.upper()}: {hint}")
        self.phase = following
        return following
