"""Errors raised by ds_odc. Each names what went wrong and, where a peer is involved, which rank."""


class ODCError(RuntimeError):
    """Base class of every ds_odc error."""


class ODCConfigError(ODCError, ValueError):
    """A ds_config entry for the "odc" stage is invalid; the message names the field."""


class ODCPeerError(ODCError):
    """A peer rank died, stalled past the timeout, or disagreed with this rank at the step."""


class ODCTimeoutError(ODCPeerError, TimeoutError):
    """A bounded wait on a peer (step rendezvous, accumulator lock) ran out of time."""
