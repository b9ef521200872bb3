"""The step protocol's words: what each round is for, and what a rank can be doing.

The control plane (``ds_odc.comm``) carries both as numbers; :data:`PROTOCOL_WORDING` is how the
protocol tells it to name them in errors, e.g. a peer waiting for a rank that is "running
forward/backward of step 3 (2 micro-batches done)" at "the step fence (engine.step)".
"""
from __future__ import annotations

import enum

from ds_odc.comm.wording import Wording


class RoundKind(enum.IntEnum):
    """What a round is for; the text is how errors name it."""

    FENCE = 1
    NORM = 2
    PUBLISH = 3
    WINDOWS_REWRITTEN = 4
    BARRIER = 5
    TEST = 6
    OPEN = 7
    GRADIENT_FENCE = 8
    DISCARD = 9
    GRADIENT_NORM = 10
    VALUES = 11
    WINDOWS_AWAY = 12
    WINDOWS_BACK = 13

    @property
    def text(self) -> str:
        return _ROUND_TEXT[self]


_ROUND_TEXT = {
    RoundKind.FENCE: "the step fence (engine.step)",
    RoundKind.NORM: "the gradient-norm exchange",
    RoundKind.PUBLISH: "publishing updated shards",
    RoundKind.WINDOWS_REWRITTEN: "publishing shards rewritten outside a step",
    RoundKind.BARRIER: "a barrier",
    RoundKind.TEST: "a test round",
    RoundKind.OPEN: "the first rendezvous after initialize (publishing shards written since)",
    RoundKind.GRADIENT_FENCE: "a gradient fence outside a step (reading gradients before engine.step)",
    RoundKind.DISCARD: "discarding gradients (optimizer.zero_grad outside a step)",
    RoundKind.GRADIENT_NORM: "a gradient-norm exchange outside a step",
    RoundKind.VALUES: "an exchange of values between steps (counts, metrics)",
    RoundKind.WINDOWS_AWAY: "moving windows off the device (engine.offload_states)",
    RoundKind.WINDOWS_BACK: "bringing windows back (engine.reload_states)",
}


class Activity(enum.IntEnum):
    """What a rank is doing, for the errors its peers raise (never used for decisions)."""

    STARTING = 0
    IDLE = 1
    MICRO_BATCHES = 2
    IN_ROUND = 3
    UPDATING = 4
    SAVING = 5
    CLOSED = 6
    LEFT = 7


_ACTIVITY_TEXT = {
    Activity.STARTING: "starting up",
    Activity.IDLE: "idle before step {step} (no micro-batch of it yet)",
    Activity.MICRO_BATCHES: "running forward/backward of step {step} ({count} micro-batches done)",
    Activity.IN_ROUND: "waiting at a rendezvous round of step {step}",
    Activity.UPDATING: "running the optimizer update of step {step}",
    Activity.SAVING: "saving a checkpoint (before step {step})",
    Activity.CLOSED: "closed its engine (engine.destroy())",
    Activity.LEFT: "left training: it tore its process group down with its ODC engine open (no engine.destroy())",
}


def round_name(kind: int) -> str:
    try:
        return RoundKind(kind).text
    except ValueError:
        return f"round kind {kind}"


def activity_text(activity: int, step: int, count: int) -> str:
    try:
        template = _ACTIVITY_TEXT[Activity(activity)]
    except ValueError:
        return f"in an unknown activity {activity}"
    return template.format(step=step, count=count)


#: The rounds outside a step that read or write a window, and which one (a round needing a window that is away,
#: after ``engine.offload_states()``, is refused naming the call).
WINDOWS_NEEDED = {RoundKind.WINDOWS_REWRITTEN: {"params"}, RoundKind.GRADIENT_FENCE: {"grads"},
                  RoundKind.GRADIENT_NORM: {"grads"}}

PROTOCOL_WORDING = Wording(round_name=round_name, activity=activity_text)
