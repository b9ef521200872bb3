"""A rank that tears its process group down with an ODC engine still open has left training.

Its peers may be waiting for it at a round (the step fence, a barrier): one-sided ODC does not use the
process group between steps, so nothing else would tell them before their no-progress bound
(``odc.timeout_s``, by default the process group's timeout). While ODC engines are alive,
``torch.distributed.destroy_process_group`` of the default group (or of every group) first marks each
live engine as closed, saying why, then runs torch's: every peer still waiting for this rank raises within
milliseconds, naming it (:func:`ds_odc.runtime.crash.left`); a peer this rank already met (the last round
of a job that ends without ``engine.destroy()``) is unaffected. Torn down in a ``finally`` while an exception
is on its way out (``try: train() finally: destroy_process_group()``), the group fails with that exception
instead, so peers see the error itself, as for an uncaught one. An engine destroyed first is not alive any
more, so the usual order, ``engine.destroy()`` then ``destroy_process_group()``, reports nothing.

The replacement is installed when the first ODC engine is built and delegates to torch's function for
everything (a job without an ODC engine, or a subgroup); it is looked up at call time by
``deepspeed.comm`` and by scripts that call ``torch.distributed.destroy_process_group(...)`` (a name a
script imported before ds_odc was keeps torch's function: the peers then learn of it at their bound).
"""
from __future__ import annotations

import sys

import torch.distributed as tdist

from ds_odc.integration.patching import PatchSet, delegating
from ds_odc.runtime import crash

_PATCHES = PatchSet("process-group teardown")


def install() -> None:
    """Idempotent; the replacement stays for the life of the process (a pass-through without ODC engines)."""
    _PATCHES.replace(tdist, "destroy_process_group", lambda original: delegating(_destroy_process_group, original))


def _destroy_process_group(original, group=None, *args, **kwargs):
    if group is None or group is tdist.GroupMember.WORLD:
        # inside a ``finally`` of a failing run the exception is still in flight: report it, not just "left"
        crash.left("destroy_process_group() with its ODC engine still open", sys.exc_info()[1])
    return original(group, *args, **kwargs)
