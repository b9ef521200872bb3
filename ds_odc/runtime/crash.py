"""An uncaught exception that ends a rank's script reaches its peers as that exception.

Without this, peers learn only that the process exited. A script that dies of an uncaught
exception passes through ``sys.excepthook`` before the interpreter exits; the hook installed here
first records the exception in the control plane of every live ODC engine of the process (the
group's failure record, :meth:`StepProtocol.fail`), so every peer raises with the origin's actual
error (as torch elastic's ``@record`` reports a worker's error), then calls the previous hook.

Scoped to the lifetime of ODC engines: the hook is installed when the first engine's protocol starts
watching and the previous one restored when the last is closed (unless something replaced the hook
after us: then ours stays, chained, rather than dropping theirs).
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Optional, Protocol


class Watched(Protocol):
    """What this module needs of a step protocol (:class:`ds_odc.runtime.step.StepProtocol`): to fail its group
    with an error, or say its rank left. A protocol, so that the step imports this module and not the reverse."""

    def fail(self, err: BaseException, where: str) -> None: ...

    def leave(self, reason: str) -> None: ...


_live: weakref.WeakSet[Watched] = weakref.WeakSet()
_lock = threading.Lock()
_previous_hook = None


def watch(protocol: Watched) -> None:
    """Report uncaught exceptions to ``protocol``'s peers while it lives (until :func:`unwatch`)."""
    global _previous_hook
    with _lock:
        _live.add(protocol)
        if _previous_hook is None:
            _previous_hook = sys.excepthook
            sys.excepthook = _report_then_chain


def unwatch(protocol: Watched) -> None:
    """``protocol`` closed; the last one to go puts the previous hook back."""
    global _previous_hook
    with _lock:
        _live.discard(protocol)
        if not _live and _previous_hook is not None and sys.excepthook is _report_then_chain:
            sys.excepthook, _previous_hook = _previous_hook, None


def installed() -> bool:
    return sys.excepthook is _report_then_chain


def _report_then_chain(exc_type, exc, traceback) -> None:
    for protocol in list(_live):
        try:
            protocol.fail(exc, "an uncaught exception that ended its script")
        except Exception:  # noqa: BLE001 - reporting must never hide the original error
            pass
    (_previous_hook or sys.__excepthook__)(exc_type, exc, traceback)


def left(reason: str, in_flight: Optional[BaseException] = None) -> int:
    """This process left training with ODC engines still open (it tore its process group down without
    ``engine.destroy()``): each live engine says so in its control block, so that peers waiting for this
    rank raise at once, naming it and ``reason``, instead of at their no-progress bound. With an exception
    ``in_flight`` (the teardown runs in a ``finally`` on the way out of a failed run) the group fails with
    that exception instead, as an uncaught one would have (the hook below would come too late: the engine
    is closed by then). Returns how many engines."""
    engines = list(_live)
    for protocol in engines:
        try:
            if in_flight is not None:
                protocol.fail(in_flight, f"an exception on the way out of training ({reason})")
            else:
                protocol.leave(reason)
        except Exception:  # noqa: BLE001 - a teardown must go on whatever the report meets
            pass
    return len(engines)
