"""Multi-process test harness: real ranks, gloo, a hang timeout that names the hung rank.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, initialises DeepSpeed's
process group (gloo, CPU accelerator) in each, calls ``fn(*args)`` and returns the list of
per-rank results. ``fn`` (and the optional ``setup``, run before the process group exists) must be module-level
functions: they are pickled by name.

* a rank that raises -> :class:`RankFailure` with every failing rank's traceback;
* ranks that have not returned after ``timeout`` seconds -> they are killed (SIGKILL) and
  :class:`RankHang` names them;
* ``report=True`` returns a :class:`RunReport` instead of raising, for tests that prove a
  configuration hangs or that a rank dies; ``wait_for`` lists the ranks whose results are needed
  (the others are killed once those have reported);
* ``pg_timeout_s`` sets the process group's timeout (``deepspeed.init_distributed(timeout=...)``),
  the bound a collective waits for a silent peer, and the default of ODC's own bound.

Ranks are forked from a forkserver that has imported torch, DeepSpeed and ds_odc once (they hold
no threads or process groups at that point), so a rank starts in a fraction of a second instead
of re-importing them. Each rank still sets its environment, its thread count and its process
group itself.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
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
#: DeepSpeed's Muon module: ~8 s per fresh process on this machine, ~0 when preloaded.
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage3",
           "deepspeed.runtime.zero.muon.muon_optimizer", "ds_odc", "ds_odc.engine", "tests.distributed.workloads"]


def _context():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when the forkserver imports DeepSpeed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_entry(fn, rank, world_size, port, results, args, env, log_path, setup, pg_timeout_s):
    _redirect_output(log_path)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    })
    os.environ.update(env or {})
    try:
        import torch
        torch.set_num_threads(1)
        import deepspeed
        import ds_odc  # noqa: F401  registers the "odc" stage
        if setup is not None:
            setup()
        if pg_timeout_s is None:
            deepspeed.init_distributed(dist_backend="gloo")
        else:
            deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=pg_timeout_s))
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
              pg_timeout_s: Optional[float] = None):
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    log_dir = tempfile.mkdtemp(prefix="ds_odc_test_logs_")
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(world_size)]
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world_size, port, results, args, env, logs[r], setup,
                                                   pg_timeout_s), daemon=True) for r in range(world_size)]
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
        return RunReport(hung, collected)
    errors = {r: v for r, (s, v) in collected.items() if s == "error"}
    if errors:
        raise RankFailure("\n".join(f"--- rank {r} failed ---\n{tb}\n--- rank {r} output (tail) ---\n{tails[r]}"
                                     for r, tb in sorted(errors.items())))
    if hung:
        raise RankHang(f"rank(s) {hung} hung: no result after {timeout:.0f}s (killed)\n" +
                       "\n".join(f"--- rank {r} output (tail) ---\n{tails[r]}" for r in hung))
    return [collected[r][1] for r in range(world_size)]
