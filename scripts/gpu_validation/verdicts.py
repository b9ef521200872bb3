"""How each kind of item's output becomes a verdict with figures (see runner.Status for the four verdicts).

Targets (docs/gpu.md): pull >= 90% and push >= 80% of a device-to-device copy of the same bytes at
>= 64 MiB; a GEMM slowed by at most 3% while peers pull from / push into its GPU.
"""
from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ElementTree

from gpu_validation.runner import Run, Status, Verdict, tail

PULL_TARGET, PUSH_TARGET, GEMM_SLOWDOWN_TARGET = 0.90, 0.80, 0.03
LARGE_MIB = 64


def tagged_json(output: str, tag: str) -> dict:
    """The JSON printed after ``tag`` on the last line that starts with it."""
    lines = [line for line in output.splitlines() if line.startswith(tag + " ")]
    if not lines:
        raise ValueError(f"no {tag} line in the output")
    return json.loads(lines[-1][len(tag) + 1:])


def read_json(run: Run, name: str) -> dict:
    with open(os.path.join(run.scratch, name)) as handle:
        return json.load(handle)


# -- pytest -------------------------------------------------------------------------------------------
def pytest_outcomes(junit_path: str) -> dict:
    """test id -> {"outcome": passed|failed|skipped, "seconds", "message"} from pytest's JUnit XML."""
    outcomes = {}
    for case in ElementTree.parse(junit_path).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", f"{child.get('message', '')}\n{child.text or ''}"
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message", "")
        outcomes[test_id] = {"outcome": outcome, "seconds": round(float(case.get("time") or 0.0), 2),
                             "message": message.strip()[:4000]}
    return outcomes


def pytest_verdict(run: Run) -> Verdict:
    """pass: every selected test passed (skips listed); not measurable: every one was skipped (the reasons
    say why); fail: a failure, an error, a crash, or a selection that matched nothing."""
    junit = os.path.join(run.scratch, "junit.xml")
    if run.returncode == 5:
        return Verdict(Status.FAIL, error="the selection matched no test (pytest exit status 5)")
    if not os.path.exists(junit):
        return Verdict(Status.FAIL, error=f"pytest exited with {run.returncode} and wrote no report:\n"
                                          f"{tail(run.output, 3000)}")
    outcomes = pytest_outcomes(junit)
    counts = {kind: sum(o["outcome"] == kind for o in outcomes.values()) for kind in ("passed", "failed", "skipped")}
    figures = {**counts, "tests": {test: [o["outcome"], o["seconds"]] for test, o in outcomes.items()}}
    skips = sorted({o["message"] for o in outcomes.values() if o["outcome"] == "skipped"})
    if skips:
        figures["skip_reasons"] = skips
    failed = [(test, o["message"]) for test, o in outcomes.items() if o["outcome"] == "failed"]
    if failed or run.returncode not in (0, None):
        head = "\n".join(f"{test}: {message.splitlines()[0][:300] if message else ''}" for test, message in failed[:8])
        detail = tail(failed[0][1], 2500) if failed else tail(run.output, 2500)
        return Verdict(Status.FAIL, figures, f"{len(failed)} failed (pytest exit {run.returncode}):\n{head}\n{detail}")
    if counts["passed"] == 0:
        return Verdict(Status.NOT_MEASURABLE, figures, "every selected test was skipped: " + "; ".join(skips))
    return Verdict(Status.PASS, figures)


# -- set-up and build -----------------------------------------------------------------------------------
def install_verdict(run: Run) -> Verdict:
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"set-up failed (exit {run.returncode}):\n{tail(run.output, 3000)}")
    return Verdict(Status.PASS, tagged_json(run.output, "INSTALLED"))


def jit_verdict(run: Run) -> Verdict:
    try:
        figures = tagged_json(run.output, "JIT_PROBE")
    except ValueError:
        return Verdict(Status.FAIL, error=f"the build probe crashed (exit {run.returncode}):\n{tail(run.output, 3000)}")
    if run.returncode != 0 or figures["problems"]:
        return Verdict(Status.FAIL, figures, "; ".join(figures["problems"]) or f"exit {run.returncode}")
    return Verdict(Status.PASS, figures)


# -- benchmarks -----------------------------------------------------------------------------------------
def bandwidth_verdict(run: Run) -> Verdict:
    """Pull and push against a copy of the same bytes, at every size >= 64 MiB, the best push CTA count."""
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    data = read_json(run, "bandwidth.json")
    rows, large = data["rows"], {}
    for row in rows:
        base = row["peer_copy_gbps"] or row["copy_gbps"]
        entry = large.setdefault(row["mib"], {"pull": row["pull_gbps"] / base, "push": 0.0, "blocks": None})
        push = row["push_fp32_gbps"] / base
        if push > entry["push"]:
            entry["push"], entry["blocks"] = push, row["push_blocks"]
    sizes = sorted(m for m in large if m >= LARGE_MIB)
    figures = {"device": data["device"], "gpus": data["gpus"], "command": data["command"],
               "what": ("pull = copy through the IPC mapping of another rank's window on the same GPU (no NVLink); "
                        "copy = device-to-device copy on that GPU") if data["gpus"] < 2 else
                       "pull over NVLink/PCIe from a peer GPU; copy = peer copy between the GPUs",
               "by_size": {str(m): {k: round(v, 3) if isinstance(v, float) else v for k, v in large[m].items()}
                           for m in sorted(large)}, "rows": rows}
    if not sizes:
        return Verdict(Status.INCONCLUSIVE, figures, f"no size >= {LARGE_MIB} MiB was measured")
    pull = min(large[m]["pull"] for m in sizes)
    push = min(large[m]["push"] for m in sizes)
    figures.update(pull_over_copy=round(pull, 3), push_over_copy=round(push, 3))
    missed = [f"{kind} reaches {100 * got:.0f}% of copy bandwidth at >= {LARGE_MIB} MiB (target {100 * target:.0f}%)"
              for kind, got, target in (("pull", pull, PULL_TARGET), ("push", push, PUSH_TARGET)) if got < target]
    return Verdict(Status.FAIL if missed else Status.PASS, figures, "; ".join(missed) or None)


def gemm_verdict(bandwidth_figures: dict) -> Verdict:
    """The GEMM slowdown rows gpu_transport.py measures with two or more GPUs."""
    rows = bandwidth_figures.get("gemm") or []
    slowdowns = {row["traffic"]: row["busy_s"] / row["alone_s"] - 1 for row in rows}
    missed = [f"{kind}: {100 * s:+.1f}%" for kind, s in slowdowns.items() if s > GEMM_SLOWDOWN_TARGET]
    figures = {"slowdown": {k: round(v, 4) for k, v in slowdowns.items()}}
    if not rows:
        return Verdict(Status.INCONCLUSIVE, figures, "no GEMM rows were measured")
    return Verdict(Status.FAIL if missed else Status.PASS, figures,
                   ("GEMM slowdown above 3%: " + ", ".join(missed)) if missed else None)


def gather_verdict(run: Run) -> Verdict:
    """A measurement without a target: pass means measured; the figures answer the question."""
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    data = read_json(run, "gather.json")
    figures = {"device": data["device"], "command": data["command"], "shapes": data["shapes"],
               "per_piece_over_batched": {f"hidden {s['hidden']} {kind}": round(s[kind]["per_piece_ms"]
                                                                                / s[kind]["batched_ms"], 3)
                                          for s in data["shapes"] for kind in ("pull", "push")}}
    return Verdict(Status.PASS, figures)


def overlap_verdict(run: Run) -> Verdict:
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    data = read_json(run, "overlap.json")
    if data["timing"] != "cuda-events":
        return Verdict(Status.INCONCLUSIVE, data, f"timed with {data['timing']}, not CUDA events: no device overlap")
    return Verdict(Status.PASS, data)


def activation_offload_verdict(run: Run) -> Verdict:
    """The issue's goal on the longest micro-batch: the planned offload cuts its peak memory above what was
    allocated before it by at least 50% for at most 5% more forward+backward time (against offload off)."""
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    data = read_json(run, "activation_offload.json")
    rows = {variant: {row["length"]: row for row in result["rows"]} for variant, result in data.items()}
    longest = max(rows["off"])
    off, planned = rows["off"][longest], rows["planned"][longest]
    if not off.get("peak"):
        return Verdict(Status.INCONCLUSIVE, error="no peak memory recorded (not a CUDA run)")
    figures = {"tokens": longest, "peak_ratio": planned["peak"] / off["peak"],
               "time_ratio": planned["seconds"] / off["seconds"]}
    if "save_on_cpu" in rows:
        figures["save_on_cpu_time_ratio"] = rows["save_on_cpu"][longest]["seconds"] / off["seconds"]
    met = figures["peak_ratio"] <= 0.5 and figures["time_ratio"] <= 1.05
    return Verdict(Status.PASS if met else Status.FAIL, figures,
                   None if met else f"goal: peak <= 50% of off at <= 5% more time; measured {figures}")


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_REFUSED = ("Device not supported", "error 999", "Unable to find injection library", "Target application terminated "
            "before first instrumented API call", "No supported device")


def sanitizer_verdict(run: Run) -> Verdict:
    """pass: every instrumented process ended with 0 errors and the test passed; fail: memcheck reported an
    error; inconclusive: the tool refused the machine, or the run under it failed without a memcheck error."""
    summaries = [int(n) for n in _SUMMARY.findall(run.output)]
    figures = {"processes_checked": len(summaries), "errors": sum(summaries)}
    refused = [marker for marker in _REFUSED if marker in run.output]
    if any(summaries):
        return Verdict(Status.FAIL, figures, "memcheck reported errors:\n" + _first_report(run.output))
    if refused or not summaries:
        return Verdict(Status.INCONCLUSIVE, figures, f"compute-sanitizer did not check the run ({refused or 'no summary'})"
                                                     f":\n{tail(run.output, 2000)}")
    if run.returncode != 0:
        return Verdict(Status.INCONCLUSIVE, figures, f"no memcheck error, but the run failed under the tool (exit "
                                                     f"{run.returncode}):\n{tail(run.output, 2000)}")
    return Verdict(Status.PASS, figures)


def _first_report(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("=========")]
    return "\n".join(lines[:40])
