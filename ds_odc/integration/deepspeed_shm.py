"""DeepSpeed's CPU shared-memory all-reduce buffers, unlinked once every rank has mapped them.

When launched by the ``deepspeed`` launcher on CPU (``LOCAL_SIZE`` set), DeepSpeed's comm layer
creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (69 MB each)
and never removes them (``ops/csrc/cpu/comm/shm.cpp``, DeepSpeed 0.19.8). Every rank maps every
peer's buffer inside ``init_distributed``, so once an ODC engine has passed its start-up barriers
each rank can unlink its own file: the mappings stay valid, and no exit path leaves the file behind.
"""
from __future__ import annotations

import os

SHM_DIR = "/dev/shm"


def allreduce_buffer_path(rank: int) -> str:
    addr = os.environ.get("MASTER_ADDR", "")
    port = os.environ.get("MASTER_PORT", "")
    return os.path.join(SHM_DIR, f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")


def release_allreduce_buffer(rank: int) -> None:
    """Unlink this rank's buffer if DeepSpeed created one. Call only after a barrier that follows
    ``init_distributed`` on every rank."""
    try:
        os.unlink(allreduce_buffer_path(rank))
    except FileNotFoundError:
        pass
