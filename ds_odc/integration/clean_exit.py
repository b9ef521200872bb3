"""How a rank leaves: a clean interpreter exit, its peers told when it tears its group down, and nothing
left in ``/dev/shm`` by DeepSpeed's CPU comm layer. Three concerns of one moment, each in its section below.

**A clean interpreter exit on gloo**: no ``terminate called without an active exception``.

The abort (SIGABRT at exit, ZeRO-3 and ODC alike, with or without ``destroy_process_group()``):

1. ``ProcessGroupGloo`` runs collectives on its worker threads (``pt_gloo_runloop``). When a worker
   finishes a collective whose Python handle is already gone, *the worker* destroys the work, and
   with it the last C++ references to tensors that have Python objects (a ``dist.all_reduce(t)`` of
   a temporary, ZeRO-3's all-gather buffers). Under torch 2.13 that decref takes the GIL
   (``TensorImpl::decref_pyobject`` -> ``pybind11::gil_scoped_acquire``), and freeing the tensor
   releases and retakes it (``THPVariable_clear``).
2. If the main thread meanwhile reaches ``Py_FinalizeEx`` (the script ended right after its last
   collective), Python 3.11 ends any other thread that takes the GIL with ``pthread_exit``. The
   forced unwind meets the ``noexcept`` destructors on the worker's stack, and the C++ runtime calls
   ``std::terminate`` with no exception in flight. The whole process aborts.

``destroy_process_group()`` does not help in DeepSpeed programs: the engine, DeepSpeed's group
registry and every parameter (``ds_process_group``) keep the process groups alive, so their
destructors, which would join the workers, never run before finalization.

The hook below runs at exit while the interpreter is still whole (``atexit``): it releases the GIL
until every gloo worker of this process is idle, i.e. waiting for work without a timeout (read from
``/proc/self/task/<tid>/syscall``). A worker that owes a decref then takes the GIL and finishes it
before finalization starts. It never issues a collective and never waits on a peer: a worker that
stays busy (a collective that its peers never join) only delays the exit by at most ``WAIT_S``.
It does not destroy anything (handlers that ``atexit`` runs after it may still use the process
group), it is a no-op when no gloo worker exists (nothing initialised, or the groups were
destroyed and freed), and it does nothing in a child forked after it was installed.
``DS_ODC_CLEAN_EXIT=0`` leaves it uninstalled.

The worker thread name (``pt_gloo_runloop``) is torch's, not an importable name, so
``ds_odc.integration.surface`` cannot check it: should a release rename it, the hook finds no worker
and does nothing (the exit is as without it), which ``tests/distributed/test_clean_exit.py`` catches.
"""
from __future__ import annotations

import atexit
import os
import platform
import sys
import time

import torch.distributed as tdist

from ds_odc.integration.patching import PatchSet, delegating
from ds_odc.runtime import crash

OFF_SWITCH = "DS_ODC_CLEAN_EXIT"
WORKER_NAME = "pt_gloo_runloop"  # c10d::ProcessGroupGloo::runLoop names its threads so
WAIT_S = 1.0                     # longest wait at a normal exit
WAIT_ON_ERROR_S = 0.1            # after an uncaught exception: the peers are likely waiting for us
BLIND_WAIT_S = 0.05              # when /proc cannot tell idle from busy
POLL_S = 0.001

#: futex(2)'s number per architecture; ``/proc/<tid>/syscall`` names the syscall by number.
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_CMD_MASK = 0x7F           # op without FUTEX_PRIVATE_FLAG / FUTEX_CLOCK_REALTIME
_FUTEX_WAIT, _FUTEX_WAIT_BITSET = 0, 9

_installed_pid: int | None = None


def _switched_off() -> bool:
    return os.environ.get(OFF_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def install() -> bool:
    """Register the exit hook once per process (``import ds_odc`` does). Registered early, it runs
    late: ``atexit`` runs handlers in reverse order, so collectives issued by handlers registered
    afterwards have completed by the time it looks. Returns whether it is installed."""
    global _installed_pid
    if _switched_off():
        return False
    if _installed_pid != os.getpid():
        _installed_pid = os.getpid()
        atexit.register(_at_exit)
    return True


def installed() -> bool:
    """Whether this process runs the hook at exit."""
    return _installed_pid == os.getpid()


def _worker_tids() -> list[str]:
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == WORKER_NAME:
                    found.append(tid)
        except OSError:  # the thread ended
            continue
    return found


def _idle(tid: str) -> bool | None:
    """True if the worker waits on its work queue (a futex wait with no timeout), False if it runs or
    waits with a timeout (for the GIL, or for a peer inside a collective), None if unknowable."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as syscall:
            fields = syscall.read().split()
    except FileNotFoundError:
        return True  # the thread ended
    except OSError:
        return None
    if not fields or fields[0] == "running" or fields[0] == "-1":
        return False
    try:
        number, op, timeout = int(fields[0]), int(fields[2], 16), int(fields[4], 16)
    except (IndexError, ValueError):
        return None
    if number != _FUTEX:
        return False
    return op & _FUTEX_CMD_MASK in (_FUTEX_WAIT, _FUTEX_WAIT_BITSET) and timeout == 0


def wait_for_idle_gloo_workers(timeout_s: float) -> bool:
    """Release the GIL until every gloo worker thread of this process is idle, at most ``timeout_s``.
    Returns True once they all are (or there are none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        tids = _worker_tids()
        if not tids:
            return True
        states = [_idle(tid) for tid in tids] if _FUTEX is not None else [None]
        if None in states:  # no way to tell: give them a moment with the GIL, once
            time.sleep(min(BLIND_WAIT_S, max(0.0, deadline - time.monotonic())))
            return False
        if all(states):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)  # releases the GIL: a worker waiting for it finishes its decref


def _at_exit() -> None:
    if os.getpid() != _installed_pid:  # a forked child: not the process that installed it
        return
    # set when the uncaught-exception report was printed (last_exc from Python 3.12 on)
    exiting_on_error = getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None
    try:
        wait_for_idle_gloo_workers(WAIT_ON_ERROR_S if exiting_on_error else WAIT_S)
    except Exception:  # noqa: BLE001 - an exit hook must never turn a clean exit into a failure
        pass


# -- peers told when this rank tears its process group down -----------------------------------------------
# A rank that tears its process group down with an ODC engine still open has left training.
#
# Its peers may be waiting for it at a round (the step fence, a barrier): one-sided ODC does not use the
# process group between steps, so nothing else would tell them before their no-progress bound
# (``odc.timeout_s``, by default the process group's timeout). While ODC engines are alive,
# ``torch.distributed.destroy_process_group`` of the default group (or of every group) first marks each
# live engine as closed, saying why, then runs torch's: every peer still waiting for this rank raises within
# milliseconds, naming it (:func:`ds_odc.runtime.crash.left`); a peer this rank already met (the last round
# of a job that ends without ``engine.destroy()``) is unaffected. Torn down in a ``finally`` while an exception
# is on its way out (``try: train() finally: destroy_process_group()``), the group fails with that exception
# instead, so peers see the error itself, as for an uncaught one. An engine destroyed first is not alive any
# more, so the usual order, ``engine.destroy()`` then ``destroy_process_group()``, reports nothing.
#
# The replacement is installed when the first ODC engine is built and delegates to torch's function for
# everything (a job without an ODC engine, or a subgroup); it is looked up at call time by
# ``deepspeed.comm`` and by scripts that call ``torch.distributed.destroy_process_group(...)`` (a name a
# script imported before ds_odc was keeps torch's function: the peers then learn of it at their bound).
_TEARDOWN = PatchSet("process-group teardown")


def install_teardown_notice() -> None:
    """Idempotent; the replacement stays for the life of the process (a pass-through without ODC engines)."""
    _TEARDOWN.replace(tdist, "destroy_process_group", lambda original: delegating(_destroy_process_group, original))


def _destroy_process_group(original, group=None, *args, **kwargs):
    if group is None or group is tdist.GroupMember.WORLD:
        # inside a ``finally`` of a failing run the exception is still in flight: report it, not just "left"
        crash.left("destroy_process_group() with its ODC engine still open", sys.exc_info()[1])
    return original(group, *args, **kwargs)


# -- DeepSpeed's CPU shared-memory all-reduce buffers ---------------------------------------------------------
# DeepSpeed's CPU shared-memory all-reduce buffers, unlinked once every rank has mapped them.
#
# When launched by the ``deepspeed`` launcher on CPU (``LOCAL_SIZE`` set), DeepSpeed's comm layer
# creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` (69 MB each)
# and never removes them (``ops/csrc/cpu/comm/shm.cpp``, DeepSpeed 0.19.8). Every rank maps every
# peer's buffer inside ``init_distributed``, so once an ODC engine has passed its start-up barriers
# each rank can unlink its own file: the mappings stay valid, and no exit path leaves the file behind.
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
