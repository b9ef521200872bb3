"""Running validation items: each in its own process group under its own timeout, inside one command's
budget, with one verdict each.

Everything streams into the output folder (a device command's files come back even when the command is
killed at its limit, and then they must say what happened):

* ``results.json`` is rewritten when an item starts (it is listed as ``running``, with its start) and when
  it ends, so a killed command still names the item that was running;
* the running item's output goes straight into ``current-item.txt`` there (the item's processes write it
  themselves, nothing is buffered here); when the item ends it is appended to ``log.txt`` and removed.

Budget (:meth:`Phase.run`): an item starts only if its usual time (``expect_s``) fits in what is left; it
then runs under ``min(timeout_s, what is left)``, so no hang costs more than its own timeout.

Standard library only: the orchestrating process imports neither torch nor CUDA, so nothing it does can
leave a CUDA context behind for the items it starts.

Verdicts (:class:`Status`): *pass* (ran and met its criterion; for a measurement without a target,
measured), *fail* (ran and missed it, crashed, or hung past its own timeout), *not measurable on this
machine* (this machine cannot show it, e.g. NVLink with one GPU: never counted as a pass), *inconclusive*
(ran but cannot be trusted, or tested only part of what it should, or not run because the budget could
not fit it or the set-up failed).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Callable, Dict, List, Optional, Sequence


class Status(str, Enum):
    PASS = "pass"
    FAIL = "fail"
    NOT_MEASURABLE = "not_measurable"
    INCONCLUSIVE = "inconclusive"

    @property
    def text(self) -> str:
        return {"not_measurable": "not measurable on this machine"}.get(self.value, self.value)


@dataclass
class Verdict:
    status: Status
    figures: dict = field(default_factory=dict)
    error: Optional[str] = None
    said: str = ""
    """one line printed with a pass (e.g. whether the operator was prebuilt or built)"""


@dataclass
class Run:
    """What one command did."""

    returncode: Optional[int]
    seconds: float
    output: str
    timed_out: bool = False
    stopped_by_budget: bool = False
    scratch: str = ""
    """the item's own directory: files it writes (junit XML, JSON figures) for its interpreter"""


def exit_code(run: Run) -> Verdict:
    """The default interpreter: exit status 0 passes."""
    if run.returncode == 0:
        return Verdict(Status.PASS)
    return Verdict(Status.FAIL, error=f"exit status {run.returncode}; output ends:\n{tail(run.output, 3000)}")


@dataclass
class Item:
    name: str
    title: str
    command: Optional[Sequence[str]] = None
    """argv; ``{scratch}`` and ``{out}`` are replaced by the item's directory and the output folder"""
    timeout_s: float = 120.0
    interpret: Callable[[Run], Verdict] = exit_code
    env: Dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    unavailable: str = ""
    """non-empty: this machine cannot show it (the reason); not run, reported as not measurable"""
    derive: Optional[Callable[[Dict[str, "ItemResult"]], Verdict]] = None
    """instead of a command: a verdict from the results of earlier items (figures one run measured)"""
    expect_s: float = 20.0
    """its usual time: it is not started when less than this is left of the budget"""
    note: str = ""
    """said with its result, whatever the verdict (e.g. what a pass on this machine does not show)"""
    required: bool = False
    """run even when ``--only`` does not name it (the machine, the set-up, the operator)"""


@dataclass
class ItemResult:
    name: str
    title: str
    status: Status
    seconds: float
    figures: dict
    error: Optional[str]
    command: Optional[str]


def tail(text: str, chars: int) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def run_command(argv: Sequence[str], timeout_s: float, env: Optional[dict] = None, cwd: Optional[str] = None,
                output_path: Optional[str] = None, grace_s: float = 5.0,
                on_start: Optional[Callable[[int], None]] = None) -> Run:
    """Run ``argv`` in a new session (its own process group). At ``timeout_s`` the whole group gets
    SIGTERM, then SIGKILL after ``grace_s``; after a normal exit, whatever the command left running in its
    group (a forkserver, a rank) is killed too. Output (stdout and stderr) goes to ``output_path`` as it
    comes. ``on_start(pid)`` is called once it runs (its pid is its process group's number).

    The leader is reaped only after its group was killed (``waitid(WNOWAIT)`` until then), so the group's
    number cannot have been reused by the time it is signalled."""
    output_path = output_path or os.devnull
    start = time.monotonic()
    with open(output_path, "wb") as out:
        try:
            process = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, cwd=cwd, start_new_session=True)
        except OSError as err:
            return Run(None, time.monotonic() - start, f"could not start {argv[0]!r}: {err}")
        try:
            if on_start is not None:
                on_start(process.pid)
            timed_out = not _exited_within(process.pid, timeout_s)
            if timed_out:
                _signal_group(process.pid, signal.SIGTERM)
                _exited_within(process.pid, grace_s)
        finally:  # also when the kit itself is stopped (SIGTERM, Ctrl-C): nothing of the item outlives it
            _signal_group(process.pid, signal.SIGKILL)
            process.wait()
    seconds = time.monotonic() - start
    output = ""
    if output_path != os.devnull:
        with open(output_path, errors="replace") as produced:
            output = produced.read()
    return Run(process.returncode, seconds, output, timed_out)


def _exited_within(pid: int, seconds: float) -> bool:
    """Wait up to ``seconds`` for ``pid`` to exit, leaving it unreaped (a zombie keeps its group's number)."""
    deadline = time.monotonic() + seconds
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class Phase:
    """Runs items in order under a total budget, streaming into ``out`` (the module docstring)."""

    RUNNING = "current-item.txt"

    def __init__(self, name: str, out: str, work: str, budget_s: float, header: dict, echo=print,
                 started: Optional[float] = None):
        self.name, self.out, self.work, self.budget_s = name, out, work, budget_s
        self.header = header
        self.results: List[ItemResult] = []
        self.running: Optional[dict] = None
        self.started = time.monotonic() if started is None else started  # the budget counts from here
        self.echo = echo
        os.makedirs(out, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        self.log_path = os.path.join(out, "log.txt")
        with open(self.log_path, "w") as log:
            log.write(f"ds_odc GPU validation, {name}\n{json.dumps(header, indent=1, default=str)}\n")
        self.write()

    @property
    def remaining_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def by_name(self) -> Dict[str, ItemResult]:
        return {r.name: r for r in self.results}

    def skip(self, item: Item, status: Status, reason: str) -> ItemResult:
        return self._record(item, Verdict(status, error=reason), 0.0, None)

    def run(self, item: Item) -> ItemResult:
        if item.unavailable:
            return self._record(item, Verdict(Status.NOT_MEASURABLE, error=item.unavailable), 0.0, None)
        if item.derive is not None:
            return self._record(item, item.derive(self.by_name()), 0.0, None)
        if self.remaining_s < item.expect_s:
            left = max(0.0, self.remaining_s)
            return self.skip(item, Status.INCONCLUSIVE, f"not started: it usually takes {item.expect_s:.0f} s and "
                                                        f"{left:.0f} s of the {self.budget_s:.0f} s budget were left "
                                                        "(rerun it with --only)")
        scratch = os.path.join(self.work, "items", item.name)
        shutil.rmtree(scratch, ignore_errors=True)  # the work folder outlives commands: no stale junit.xml
        os.makedirs(scratch)
        argv = [part.replace("{scratch}", scratch).replace("{out}", self.out) for part in item.command]
        limit = min(item.timeout_s, self.remaining_s)
        env = {**os.environ, **item.env}
        self.echo(f"[{self.name}] {item.name}: {item.title} (at most {limit:.0f} s)")
        self.running = {"name": item.name, "title": item.title, "status": "running", "command": " ".join(argv),
                        "limit_s": round(limit, 1), "started_at_s": round(time.monotonic() - self.started, 1),
                        "output": self.RUNNING}
        self.write()
        running_path = os.path.join(self.out, self.RUNNING)
        run = run_command(argv, limit, env=env, cwd=item.cwd, output_path=running_path, on_start=self._started)
        run.scratch = scratch
        run.stopped_by_budget = run.timed_out and limit < item.timeout_s
        if run.timed_out:
            verdict = Verdict(Status.INCONCLUSIVE if run.stopped_by_budget else Status.FAIL,
                              error=(f"stopped at the budget after {run.seconds:.0f} s" if run.stopped_by_budget
                                     else f"timed out after {item.timeout_s:.0f} s (its process group was killed)")
                              + f"; output ends:\n{tail(run.output, 3000)}")
        else:
            try:
                verdict = item.interpret(run)
            except Exception as err:  # noqa: BLE001 - a broken interpreter is this item's failure, not the kit's
                verdict = Verdict(Status.FAIL, error=f"reading the result failed: {type(err).__name__}: {err}")
        self.running = None
        result = self._record(item, verdict, run.seconds, " ".join(argv), run.output)
        try:
            os.unlink(running_path)  # its output is in log.txt now
        except FileNotFoundError:
            pass
        return result

    def _started(self, pid: int) -> None:
        self.running["process_group"] = pid
        self.write()

    def _record(self, item: Item, verdict: Verdict, seconds: float, command: Optional[str],
                output: str = "") -> ItemResult:
        figures = dict(verdict.figures)
        if item.note:
            figures["note"] = item.note
        if verdict.said:
            figures["said"] = verdict.said
        result = ItemResult(item.name, item.title, verdict.status, round(seconds, 2), figures, verdict.error,
                            command)
        self.results.append(result)
        with open(self.log_path, "a") as log:
            log.write(f"\n{'=' * 100}\n{item.name}: {item.title}\ncommand: {command}\n{'-' * 100}\n")
            log.write(_clip(output))
            log.write(f"\n{'-' * 100}\n{item.name}: {verdict.status.text} ({seconds:.1f} s)"
                      + (f"\n{verdict.error}" if verdict.error else "") + (f"\nnote: {item.note}" if item.note else "")
                      + "\n")
        self.echo(f"[{self.name}] {item.name}: {verdict.status.text} ({seconds:.1f} s)"
                  + (f" - {verdict.error.splitlines()[0][:200]}" if verdict.error else "")
                  + (f" - {verdict.said}" if verdict.said else ""))
        self.write()
        return result

    def counts(self) -> Dict[str, int]:
        return {status.value: sum(r.status == status for r in self.results) for status in Status}

    def closing_line(self) -> str:
        counts = self.counts()
        return f"{counts['pass']} passed, {counts['fail']} failed"

    def detail_line(self) -> str:
        counts = self.counts()
        return (f"{self.name}: {counts['not_measurable']} not measurable on this machine, "
                f"{counts['inconclusive']} inconclusive")

    def write(self) -> str:
        path = os.path.join(self.out, "results.json")
        items = [dict(asdict(r), status=r.status.value) for r in self.results]
        if self.running:
            items.append(self.running)
        document = {"command_name": self.name, **self.header, "seconds": round(time.monotonic() - self.started, 1),
                    "budget_s": self.budget_s, "summary": self.counts(), "closing": self.closing_line(),
                    "rerun": self.rerun_line(), "items": items}
        temporary = path + ".tmp"
        with open(temporary, "w") as out:
            json.dump(document, out, indent=1, default=str)
        os.replace(temporary, path)
        return path

    def rerun_line(self) -> Optional[str]:
        """The command that reruns what failed or did not finish (None when nothing needs it)."""
        names = [r.name for r in self.results if r.status in (Status.FAIL, Status.INCONCLUSIVE)]
        return f"python3 scripts/gpu_validate.py --only {' '.join(names)} --out $OUT" if names else None

    def finish(self) -> int:
        """Write the results, print the closing lines; the exit status: 0 when nothing failed."""
        self.write()
        with open(self.log_path, "a") as log:
            log.write(f"\n{self.detail_line()}\n{self.closing_line()}\n")
        self.echo(self.detail_line())
        if self.rerun_line():
            self.echo(f"rerun: {self.rerun_line()}")
        self.echo(self.closing_line())
        sys.stdout.flush()
        return 1 if self.counts()["fail"] else 0


#: Output kept per item in log.txt: the head and the tail (a log of many MB cannot come back from a device).
LOG_HEAD, LOG_TAIL = 20_000, 150_000


def _clip(output: str) -> str:
    if len(output) <= LOG_HEAD + LOG_TAIL:
        return output
    return (output[:LOG_HEAD] + f"\n[... {len(output) - LOG_HEAD - LOG_TAIL} characters left out ...]\n"
            + output[-LOG_TAIL:])
