"""Errors raised by ds_odc. Each names what went wrong and, where a peer is involved, which rank."""


class ODCError(RuntimeError):
    """Base class of every ds_odc error."""


class ODCConfigError(ODCError, ValueError):
    """A ds_config entry for the "odc" stage is invalid; the message names the field."""


class ODCPeerError(ODCError):
    """A peer rank died, failed, stalled past the timeout, or disagreed with this rank at a rendezvous.
    ``record`` (a :class:`~ds_odc.comm.failure.FailureRecord`, where known) names the rank at the
    origin of the failure, where it happened and its error."""

    def __init__(self, message: str, record=None):
        super().__init__(message)
        self.record = record


class ODCTimeoutError(ODCPeerError, TimeoutError):
    """A bounded wait on a peer (step rendezvous, accumulator lock) ran out of time."""


class ODCGroupFailedError(ODCPeerError):
    """The ODC group failed earlier (on this rank or another): the engine refuses to pull, push or
    step, because results after a failure would be wrong. ``record`` says who failed, where and why."""


class ODCStateError(ODCError):
    """An operation was called in a phase of the step protocol that does not allow it (a pull while
    the owners rewrite their shards, a push after the fence, a step inside a step)."""
