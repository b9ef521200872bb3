"""The bound for a silent peer: ODC waits as long as DeepSpeed's process groups do, unless told otherwise.

DeepSpeed gives its process groups a timeout (``deepspeed.init_distributed(timeout=...)``, default
``deepspeed.constants.default_pg_timeout``: 10 minutes, or ``DEEPSPEED_TIMEOUT`` minutes). A collective
waits that long for a peer that does not arrive; ODC's step rendezvous waits the same time for a
peer that makes no progress, so that switching a job from stage 3 to "odc" does not make ordinary
host-side work between backward and step (evaluation, logging, saving) an error.
"""
from __future__ import annotations

import torch
import torch.distributed as tdist


def process_group_timeout_s(group=None) -> float:
    """Seconds the process group ``group`` (default: the world) waits in a collective.

    Read from the group's backend options (a private attribute of torch's ProcessGroup backends,
    listed in :mod:`ds_odc.integration.surface`); DeepSpeed's default when it cannot be read."""
    from deepspeed.constants import default_pg_timeout

    try:
        pg = group if group is not None else tdist.distributed_c10d._get_default_group()
        backend = pg._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return float(default_pg_timeout.total_seconds())


def resolve_timeout_s(configured) -> float:
    """``zero_optimization.odc.timeout_s`` if set, else the timeout of the world's process group: the
    one ``deepspeed.init_distributed(timeout=...)`` sets (groups DeepSpeed derives from it, such as the
    data-parallel group, get torch's own default, not the user's)."""
    return float(configured) if configured is not None else process_group_timeout_s(None)
