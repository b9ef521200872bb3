"""Multi-process test harness: real ranks, gloo (or NCCL), a hang timeout that names the hung rank.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes, initialises DeepSpeed's
process group in each (``backend="gloo"`` by default, ``"nccl"`` where the ranks have a GPU each;
CPU accelerator unless ``env`` names another), calls ``fn(*args)`` and returns the list of per-rank
results. ``fn`` (and the optional ``setup``, run before the process group exists) must be module-level
functions: they travel by name (module and qualified name) and are imported in the rank.

* a rank that raises -> :class:`RankFailure` with every failing rank's traceback;
* ranks that have not returned after ``timeout`` seconds -> they are killed (SIGKILL) and
  :class:`RankHang` names them;
* ``report=True`` returns a :class:`RunReport` instead of raising, for tests that prove a
  configuration hangs or that a rank dies; ``wait_for`` lists the ranks whose results are needed
  (the others are killed once those have reported);
* ``pg_timeout_s`` sets the process group's timeout (``deepspeed.init_distributed(timeout=...)``),
  the bound a collective waits for a silent peer, and the default of ODC's own bound.

How a rank starts (:func:`start_method`):

* CPU ranks on gloo are forked from a forkserver that has imported torch, DeepSpeed and ds_odc once
  (they hold no threads or process groups at that point), so a rank starts in a fraction of a second
  instead of re-importing them. DeepSpeed fixes its accelerator when it is imported, and the
  forkserver imported it with ``DS_ACCELERATOR=cpu``: every rank forked from it has the CPU
  accelerator, whatever its own environment says;
* so a run whose ``env`` names another accelerator (``"cuda"``), or that asks for NCCL, *spawns*
  fresh interpreters instead. Nothing but this module (stdlib only) is imported before the rank has
  set its environment: ``fn`` and ``setup`` travel as (module, name) and ``args`` as pickled bytes,
  so not even the workload module (which imports DeepSpeed) is loaded before ``DS_ACCELERATOR`` is set.

Nothing here touches CUDA in the parent or in the forkserver: the forkserver's preloads leave the CUDA
driver alone (``forkserver_setup``; ``tests/distributed/test_harness_accelerator.py`` checks it), so its
ranks are no "bad forks", and a CUDA rank initialises CUDA itself.
"""
from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, List, Optional


class RankFailure(AssertionError):
    pass


class RankHang(AssertionError):
    pass


@dataclass
class RunReport:
    hung_ranks: List[int]
    outcomes: dict  # rank -> ("ok", value) or ("error", traceback)
    pids: List[int] = field(default_factory=list)  # the ranks' processes (all ended, or killed, by now)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _redirect_output(log_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


def _encode(value) -> bytes:
    import torch  # tensors travel as torch.save bytes: no shared-memory handles to outlive the rank

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _decode(payload: bytes):
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)


def _tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])
    except OSError:
        return ""


#: What the forkserver imports once; ranks forked from it start with these modules loaded. Besides the
#: obvious ones, building the first optimizer imports torch._dynamo (torch.optim's compile guard) and
#: DeepSpeed's Muon module: ~8 s per fresh process on this machine, ~0 when preloaded; transformers' Llama and
#: Trainer: 3.4 s per rank of every Hugging Face test; forkserver_warm: DeepSpeed's operator probe and its
#: shared-memory collective (0.1-0.4 s per rank of every launch). First of all, forkserver_setup keeps those
#: imports from initialising CUDA (see there).
PRELOAD = ["tests.support.forkserver_setup", "torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.engine",
           "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.zero.muon.muon_optimizer", "ds_odc", "ds_odc.engine", "tests.support.workloads",
           "transformers", "transformers.models.llama.modeling_llama", "transformers.trainer",
           "tests.support.forkserver_warm"]


BACKENDS = ("gloo", "nccl")


def start_method(env: Optional[dict], backend: str) -> str:
    """"forkserver" for CPU ranks on gloo (fast, preloaded); "spawn" when the ranks need another
    accelerator or NCCL, which a rank forked from the CPU-preloaded forkserver could never get."""
    if backend not in BACKENDS:
        raise ValueError(f"run_ranks: backend must be one of {BACKENDS}, got {backend!r}")
    accelerator = (env or {}).get("DS_ACCELERATOR", "cpu")
    return "forkserver" if accelerator == "cpu" and backend == "gloo" else "spawn"


def _context(method: str):
    if method == "spawn":
        return mp.get_context("spawn")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when the forkserver imports DeepSpeed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _reference(fn: Optional[Callable]):
    """(module, qualified name) of a module-level function; None stays None."""
    if fn is None:
        return None
    if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
        raise ValueError(f"run_ranks needs module-level functions of an importable module, got {fn!r}")
    return fn.__module__, fn.__qualname__


def _resolve(reference):
    if reference is None:
        return None
    module, qualname = reference
    target = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _rank_entry(fn_ref, rank, world_size, port, results, payload, env, log_path, setup_ref, pg_timeout_s, backend):
    _redirect_output(log_path)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    })
    os.environ.update(env or {})
    try:
        # first import of DeepSpeed in a spawned rank: after DS_ACCELERATOR is set (module docstring)
        import torch
        torch.set_num_threads(1)
        import deepspeed

        import ds_odc  # noqa: F401  registers the "odc" stage
        fn, setup, args = _resolve(fn_ref), _resolve(setup_ref), pickle.loads(payload)
        if setup is not None:
            setup()
        if pg_timeout_s is None:
            deepspeed.init_distributed(dist_backend=backend)
        else:
            deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=pg_timeout_s))
        value = fn(*args)
        results.put((rank, "ok", _encode(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as tdist
            if tdist.is_initialized():
                tdist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240.0, report: bool = False,
              env: Optional[dict] = None, setup: Optional[Callable] = None, wait_for: Optional[List[int]] = None,
              pg_timeout_s: Optional[float] = None, backend: str = "gloo"):
    ctx = _context(start_method(env, backend))
    fn_ref, setup_ref, payload = _reference(fn), _reference(setup), pickle.dumps(args)
    results = ctx.Queue()
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="ds_odc_test_logs_")
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world_size)]
    procs = [ctx.Process(target=_rank_entry, args=(fn_ref, r, world_size, port, results, payload, env, logs[r],
                                                   setup_ref, pg_timeout_s, backend), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    collected: dict = {}
    deadline = time.monotonic() + timeout
    try:
        needed = set(range(world_size) if wait_for is None else wait_for)
        while not needed <= set(collected) and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
                collected[rank] = (status, value)
            except queue.Empty:
                dead_silent = [r for r, p in enumerate(procs) if not p.is_alive() and r not in collected]
                if dead_silent:
                    time.sleep(1.0)  # let a last message arrive
                    while not results.empty():
                        rank, status, value = results.get()
                        collected[rank] = (status, value)
                    for r in dead_silent:
                        if r not in collected:
                            collected[r] = ("error", f"rank {r} exited with code {procs[r].exitcode} "
                                                     "without reporting")
    finally:
        hung = [r for r in range(world_size) if r not in collected]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
    collected = {r: (s, _decode(v) if s == "ok" else v) for r, (s, v) in collected.items()}
    tails = {r: _tail(logs[r]) for r in range(world_size)}
    for path in logs:
        os.unlink(path) if os.path.exists(path) else None
    os.rmdir(log_dir)
    if report:
        return RunReport(hung, collected, [proc.pid for proc in procs])
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise RankFailure("\n".join(f"--- rank {r} failed ---\n{tb}\n--- rank {r} output (tail) ---\n{tails[r]}"
                                     for r, tb in sorted(errors.items())))
    if hung:
        raise RankHang(f"rank(s) {hung} hung: no result after {timeout:.0f}s (killed)\n" +
                       "\n".join(f"--- rank {r} output (tail) ---\n{tails[r]}" for r in hung))
    return [collected[r][1] for r in range(world_size)]
