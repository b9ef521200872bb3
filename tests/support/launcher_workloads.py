"""What the ranks run in test_launchers.py: ranks that believe they are on different hosts."""
import os
import socket

import deepspeed

from tests.support.workloads import ds_config, make_model


def pretend_one_host_per_rank():
    """``setup`` hook (runs before the process group exists): rank r reports host ``node-r``."""
    host = f"node-{os.environ['RANK']}"
    socket.gethostname = lambda: host


def pretend_uneven_nodes():
    """``setup`` hook: ranks 0-1 report host ``node-0``, rank 2 ``node-1`` (nodes of 2 and 1 ranks)."""
    host = "node-0" if int(os.environ["RANK"]) < 2 else "node-1"
    socket.gethostname = lambda: host


def pretend_interleaved_nodes():
    """``setup`` hook: rank r reports host ``node-{r % 2}`` (ranks not numbered node by node)."""
    host = f"node-{int(os.environ['RANK']) % 2}"
    socket.gethostname = lambda: host


def initialize_odc():
    try:
        engine, *_ = deepspeed.initialize(model=make_model(), config=ds_config("odc"))
    except Exception as err:  # noqa: BLE001 - the error is the result
        return f"{type(err).__name__}: {err}"
    engine.destroy()
    return None
