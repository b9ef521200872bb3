"""An uncaught exception that ends a rank's script reaches its peers as that exception.

Without this, peers learn only that the process exited. A script that dies of an uncaught
exception passes through ``sys.excepthook`` before the interpreter exits; the hook installed here
first records the exception in the control plane of every live ODC engine of the process (the
group's failure record, :meth:`StepProtocol.fail`), so every peer raises with the origin's actual
error (as torch elastic's ``@record`` reports a worker's error), then calls the previous hook.
"""
from __future__ import annotations

import sys
import threading
import weakref

_live = weakref.WeakSet()
_lock = threading.Lock()
_previous_hook = None


def watch(protocol) -> None:
    """Report uncaught exceptions to ``protocol``'s peers while it lives."""
    global _previous_hook
    with _lock:
        _live.add(protocol)
        if _previous_hook is None:
            _previous_hook = sys.excepthook
            sys.excepthook = _report_then_chain


def _report_then_chain(exc_type, exc, traceback) -> None:
    for protocol in list(_live):
        try:
            protocol.fail(exc, "an uncaught exception that ended its script")
        except Exception:  # noqa: BLE001 - reporting must never hide the original error
            pass
    (_previous_hook or sys.__excepthook__)(exc_type, exc, traceback)
