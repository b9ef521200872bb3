"""Memory ordering of the control words: release stores and acquire loads, on every architecture.

Ranks hand each other data through shared memory in one pattern: the writer fills a payload with
plain stores, then stores a 64-bit control word (a round's sequence number, a state); the reader
loads the control word, then the payload. That is correct only if the control-word store is a
*release* and its load an *acquire*: otherwise a reader may see the new sequence number and the
old payload (a stale micro-batch count, a half-written shard).

* x86-64 is TSO: plain stores are not reordered with earlier stores, nor plain loads with later
  loads, so plain accesses already are release/acquire;
* aarch64 (Grace, GH200, Graviton), POWER and others are weakly ordered: the accesses go through
  the ``ds_odc_atomics`` operator (``ops/csrc/odc_atomics.cpp``, ``__atomic_*`` builtins: ``stlr`` /
  ``ldar`` on aarch64), JIT-built with ninja on first use.

The operator is used wherever it can be built, x86-64 included; without it x86-64 falls back to
plain accesses (correct under TSO, said in ``python -m ds_odc report``) and any other architecture
refuses to allocate windows, naming why the operator could not be built.
"""
from __future__ import annotations

import ctypes
import platform
import threading

import torch

from ds_odc.errors import ODCConfigError

#: Architectures whose plain 64-bit loads and stores are single accesses (atomic when aligned) that already order as
#: acquire and release (TSO): x86-64. Not 32-bit x86: TSO too, but it stores a 64-bit word as two 32-bit halves, so a
#: peer could read half of a new sequence number.
TSO_MACHINES = ("x86_64", "amd64")

_lock = threading.Lock()
_ordering = None


class OpOrdering:
    """Release/acquire through the compiled ``ds_odc_atomics`` operator."""

    name = "release/acquire (ds_odc_atomics operator)"

    def __init__(self, library: ctypes.CDLL):
        self._store = library.odc_store_release_i64
        self._store.argtypes = (ctypes.c_void_p, ctypes.c_int64)
        self._store.restype = None
        self._load = library.odc_load_acquire_i64
        self._load.argtypes = (ctypes.c_void_p,)
        self._load.restype = ctypes.c_int64

    def store_release(self, words: torch.Tensor, index: int, value: int) -> None:
        self._store(words.data_ptr() + 8 * index, int(value))

    def load_acquire(self, words: torch.Tensor, index: int) -> int:
        return self._load(words.data_ptr() + 8 * index)


class TSOOrdering:
    """Plain accesses: release/acquire on a TSO machine (x86-64), and only there."""

    name = "plain stores and loads (x86-64 TSO; the ds_odc_atomics operator could not be built)"

    def store_release(self, words: torch.Tensor, index: int, value: int) -> None:
        words[index] = value

    def load_acquire(self, words: torch.Tensor, index: int) -> int:
        return int(words[index])


def memory_ordering():
    """The ordering for this process (built or loaded once): the operator if it can be had, else
    the TSO fallback on x86-64; elsewhere :class:`ODCConfigError` naming why."""
    global _ordering
    with _lock:
        if _ordering is None:
            _ordering = _resolve()
        return _ordering


def _resolve():
    from ds_odc.ops_builder import ATOMICS, load_op

    try:
        return OpOrdering(load_op(ATOMICS))
    except Exception as err:  # noqa: BLE001 - the reason goes into the fallback's or the refusal's text
        reason = f"{type(err).__name__}: {err}"
    if platform.machine().lower() in TSO_MACHINES:
        fallback = TSOOrdering()
        fallback.name = f"{fallback.name}: {reason}"
        return fallback
    raise ODCConfigError(
        f"ODC needs release/acquire ordering of its shared control words on {platform.machine()} (a weakly "
        f"ordered CPU), from its ds_odc_atomics operator, which could not be built: {reason}. Install a C++ "
        "compiler and ninja (pip install ninja), or set TORCH_EXTENSIONS_DIR to a writable directory.")


def describe() -> tuple:
    """``(usable, description)`` without building anything, for ``python -m ds_odc report``."""
    from ds_odc.ops_builder import ATOMICS, op_status

    if _ordering is not None:
        return True, _ordering.name
    status = next(s for s in op_status() if s["name"] == ATOMICS.name)
    if status["built"] or status["buildable"]:
        return True, OpOrdering.name + ("" if status["built"] else ", built on first use")
    if platform.machine().lower() in TSO_MACHINES:
        return True, f"plain stores and loads (x86-64 TSO), the operator is not buildable: {status['reason']}"
    return False, f"the operator is not buildable on {platform.machine()}: {status['reason']}"
