"""How each kind of item's output becomes a verdict with figures (see runner.Status for the four verdicts).

A pass must mean the thing was tested: a pytest item passes only when every selected test ran and passed
(some skipped: inconclusive, all skipped: not measurable); compute-sanitizer passes only when the tests
under it passed too; the JIT item only when it really compiled; the overlap item only when the timeline it
reads is consistent with the host's clock.

Targets (docs/gpu.md): push >= 80% of a local ``acc.add_(grad)`` of the same elements at >= 64 MiB (a push
moves what the add moves: the gradient read, the accumulator read and written); pull >= 90% of a copy of
the same bytes between two GPUs (with one GPU a pull *is* a device-to-device copy: not measurable);
>= 80% of pull and of push time hidden behind compute; a GEMM slowed by at most 3% while peers pull from /
push into its GPU.
"""
from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ElementTree

from gpu_validation.runner import Run, Status, Verdict, tail

PULL_TARGET, PUSH_TARGET, GEMM_SLOWDOWN_TARGET, HIDDEN_TARGET = 0.90, 0.80, 0.03, 0.80
LARGE_MIB = 64
#: the CUDA-event timeline's step time may differ from the host's clock around the same step by this much
TIMELINE_TOLERANCE = 0.10


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
    """pass: every selected test ran and passed; inconclusive: some passed, some were skipped (they tested
    nothing: the reasons are listed); not measurable: every one was skipped; fail: a failure, an error, a
    crash, or a selection that matched nothing."""
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
    if counts["skipped"]:
        return Verdict(Status.INCONCLUSIVE, figures, f"{counts['skipped']} of {len(outcomes)} selected tests were "
                                                     "skipped, so part of the item tested nothing: " + "; ".join(skips))
    return Verdict(Status.PASS, figures)


# -- set-up and build -----------------------------------------------------------------------------------
def machine_verdict(cpu_smoke: bool):
    """The machine item: pass with what it read; on a GPU run, fail when torch sees no GPU (nothing else
    could run)."""
    def verdict(run: Run) -> Verdict:
        machine = tagged_json(run.output, "MACHINE")
        if not cpu_smoke and not machine.get("cuda_available"):
            return Verdict(Status.FAIL, machine, f"torch {machine.get('torch')} sees no CUDA GPU (driver "
                                                 f"{machine.get('driver')}): {machine.get('torch_error', '')}")
        sharing = machine.get("sharing", {})
        said = (f"{machine.get('gpus', 0)} GPU(s) {[d['name'] for d in machine.get('devices', [])]}, compute mode "
                f"{machine.get('compute_modes') or 'n/a'}, MIG {machine.get('mig') or 'n/a'}, MPS "
                f"{'on' if machine.get('mps') else 'off'}" + (f"; {sharing['why']}" if sharing.get("why") else ""))
        return Verdict(Status.PASS, machine, said=said)
    return verdict


def install_verdict(run: Run) -> Verdict:
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"set-up failed (exit {run.returncode}):\n{tail(run.output, 3000)}")
    figures = tagged_json(run.output, "INSTALLED")
    return Verdict(Status.PASS, figures, said="reused from an earlier command" if figures.get("reused") else "")


def cuda_op_verdict(run: Run) -> Verdict:
    """pass: the CUDA operator loaded, saying whether it was cached, prebuilt or built (and why)."""
    try:
        figures = tagged_json(run.output, "CUDA_OP")
    except ValueError:
        return Verdict(Status.FAIL,
                       error=f"the operator did not load (exit {run.returncode}):\n{tail(run.output, 3000)}")
    if "not_measurable" in figures:
        return Verdict(Status.NOT_MEASURABLE, figures, figures["not_measurable"])
    if run.returncode != 0:
        return Verdict(Status.FAIL, figures, f"exit {run.returncode}: the operator lacks scatter_add")
    return Verdict(Status.PASS, figures, said=f"{figures['how']} ({figures['why']}; {figures['seconds']} s)")


def jit_verdict(run: Run) -> Verdict:
    """pass: every required operator was compiled here, into a folder that held no build of it before."""
    try:
        figures = tagged_json(run.output, "JIT_PROBE")
    except ValueError:
        return Verdict(Status.FAIL, error=f"the build probe crashed (exit {run.returncode}):\n{tail(run.output, 3000)}")
    problems = list(figures["problems"])
    for name, op in figures["ops"].items():
        if op.get("required") and op.get("cached_before"):
            problems.append(f"{name} was already built in {op.get('directory')}: nothing was compiled")
        if op.get("required") and op.get("compiled") is False:
            problems.append(f"{name}: no new library appeared: nothing was compiled")
    if run.returncode != 0 or problems:
        return Verdict(Status.FAIL, figures, "; ".join(problems) or f"exit {run.returncode}")
    return Verdict(Status.PASS, figures, said=", ".join(f"{n} compiled in {o['build_s']} s"
                                                         for n, o in figures["ops"].items() if o.get("required")))


def nvshmem_verdict(run: Run) -> Verdict:
    """The nvshmem item (nvshmem_probe.py): not measurable when nvshmem4py, a CUDA torch or a GPU is missing
    (the reason said); pass when the uid bootstrap and init ran, get and put moved the peer's bytes exactly,
    the bf16 -> fp32 accumulate equals torch's bit for bit, and NVSHMEM was finalized. The GB/s are figures
    without a target (the first measurement)."""
    try:
        figures = tagged_json(run.output, "NVSHMEM")
    except ValueError:
        return Verdict(Status.FAIL, error=f"the probe printed no result (exit {run.returncode}):\n"
                                          f"{tail(run.output, 3000)}")
    if "not_measurable" in figures:
        return Verdict(Status.NOT_MEASURABLE, figures, figures["not_measurable"])
    problems = list(figures.get("problems") or [])
    if not problems and figures.get("finalized") is not True:
        problems.append("NVSHMEM was not finalized")
    if run.returncode != 0 or problems:
        return Verdict(Status.FAIL, figures, "; ".join(problems) or f"exit {run.returncode}")
    said = (f"{figures['n_pes']} PE(s), libnvshmem {figures.get('libnvshmem')}: get {figures['get']['gbps']} GB/s, "
            f"put {figures['put']['gbps']} GB/s (torch copy {figures['torch_copy']['gbps']}), bf16->fp32 add "
            f"{figures['accumulate']['gbps']} GB/s, exact")
    return Verdict(Status.PASS, figures, said=said)


# -- benchmarks -----------------------------------------------------------------------------------------
def bandwidth_verdict(run: Run) -> Verdict:
    """Push against a local ``acc.add_(grad)`` of the same elements (the same bytes moved), at every size
    >= 64 MiB, with the best push block count; pull against a copy of the same bytes between two GPUs, which
    one GPU cannot show (a pull there is a device-to-device copy: reported as not measurable)."""
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    data = read_json(run, "bandwidth.json")
    large = {}
    for row in data["rows"]:
        entry = large.setdefault(row["mib"], {"push_over_add": 0.0, "blocks": None,
                                              "pull_over_copy": (row["pull_gbps"] / row["peer_copy_gbps"]
                                                                 if row.get("peer_copy_gbps") else None)})
        ratio = row["add_fp32_s"] / row["push_fp32_s"]
        if ratio > entry["push_over_add"]:
            entry["push_over_add"], entry["blocks"] = ratio, row["push_blocks"]
    sizes = sorted(m for m in large if m >= LARGE_MIB)
    figures = {"device": data["device"], "gpus": data["gpus"], "command": data["command"],
               "by_size": {str(m): {k: round(v, 3) if isinstance(v, float) else v for k, v in large[m].items()}
                           for m in sorted(large)}, "rows": data["rows"]}
    if not sizes:
        return Verdict(Status.INCONCLUSIVE, figures, f"no size >= {LARGE_MIB} MiB was measured")
    push = min(large[m]["push_over_add"] for m in sizes)
    figures["push_over_add"] = round(push, 3)
    missed = [] if push >= PUSH_TARGET else [
        f"push reaches {100 * push:.0f}% of a local add at >= {LARGE_MIB} MiB (target {100 * PUSH_TARGET:.0f}%)"]
    if data["gpus"] < 2:
        figures["pull_over_copy"] = "not measurable on one GPU: a pull there is a device-to-device copy"
    else:
        pull = min(large[m]["pull_over_copy"] for m in sizes)
        figures["pull_over_copy"] = round(pull, 3)
        if pull < PULL_TARGET:
            missed.append(f"pull reaches {100 * pull:.0f}% of a peer copy at >= {LARGE_MIB} MiB "
                          f"(target {100 * PULL_TARGET:.0f}%)")
    pulled = (f"{100 * figures['pull_over_copy']:.0f}% of a peer copy" if data["gpus"] >= 2
              else "not measurable (one GPU)")
    said = f"push {100 * push:.0f}% of a local add; pull {pulled}"
    return Verdict(Status.FAIL if missed else Status.PASS, figures, "; ".join(missed) or None, said=said)


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
    """The fraction of pull and of push time beside compute, from the CUDA-event timeline, against the
    target; only once the timeline is shown sound: timed with CUDA events, every step's timeline length
    within 10% of the host's clock around the same step, pulls and pushes recorded, fractions in [0, 1]."""
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    data = read_json(run, "overlap.json")
    if data["timing"] != "cuda-events":
        return Verdict(Status.INCONCLUSIVE, data, f"timed with {data['timing']}, not CUDA events: no device overlap")
    unsound = []
    worst = data.get("timeline_over_host")
    if worst is None:
        unsound.append("no host step times to check the timeline against")
    elif abs(worst - 1.0) > TIMELINE_TOLERANCE:
        unsound.append(f"a step's timeline length is {worst:.2f}x the host's clock around it")
    for kind in ("pull", "push"):
        entry = data[kind]
        if not entry["busy_s"] > 0:
            unsound.append(f"no {kind} time was recorded")
        if not 0.0 <= entry["hidden_fraction"] <= 1.0:
            unsound.append(f"{kind} hidden fraction {entry['hidden_fraction']} is outside [0, 1]")
    if unsound:
        return Verdict(Status.FAIL, data, "the timeline is not sound: " + "; ".join(unsound))
    missed = [f"{kind}: {100 * data[kind]['hidden_fraction']:.0f}% hidden (target {100 * HIDDEN_TARGET:.0f}%)"
              for kind in ("pull", "push") if data[kind]["hidden_fraction"] < HIDDEN_TARGET]
    said = ", ".join(f"{kind} {100 * data[kind]['hidden_fraction']:.0f}% hidden" for kind in ("pull", "push"))
    return Verdict(Status.FAIL if missed else Status.PASS, data, "; ".join(missed) or None, said=said)


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


def split_memory_verdict(run: Run) -> Verdict:
    """A sample split over p ranks must cut each member's peak GPU memory over forward and backward: pass when the
    largest member's peak over 2 ranks is at most 60% of the whole sample's, and over 4 ranks at most 35% (the
    saved activations fall as 1/p; gathered parameters and gradient slices do not: CPU ranks measured 0.54 and
    0.29, docs/benchmarks.md)."""
    if run.returncode != 0:
        return Verdict(Status.FAIL, error=f"exit {run.returncode}:\n{tail(run.output, 3000)}")
    cases = {row["case"]: row for row in read_json(run, "split_memory.json")}
    if any("cuda_fwd_bwd_peak_mb" not in row for row in cases.values()):
        return Verdict(Status.INCONCLUSIVE, error="no GPU peak recorded (not a CUDA run)")
    whole = max(cases["whole"]["cuda_fwd_bwd_peak_mb"])
    figures = {"whole_mb": whole, **{f"{case}_mb": max(cases[case]["cuda_fwd_bwd_peak_mb"]) for case in cases
                                     if case != "whole"}}
    ratios = {case: max(cases[case]["cuda_fwd_bwd_peak_mb"]) / whole
              for case in ("split-2", "split-4") if case in cases}
    figures.update({f"{case}_ratio": round(ratio, 3) for case, ratio in ratios.items()})
    met = ratios.get("split-2", 0.0) <= 0.6 and ratios.get("split-4", 0.0) <= 0.35
    return Verdict(Status.PASS if met else Status.FAIL, figures,
                   None if met else f"goal: split-2 <= 0.60 and split-4 <= 0.35 of whole; measured {figures}")


_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) errors?")
_REFUSED = ("Device not supported", "error 999", "Unable to find injection library", "Target application terminated "
            "before first instrumented API call", "No supported device")


def sanitizer_verdict(run: Run) -> Verdict:
    """pass: every instrumented process ended with 0 errors *and* the tests under the tool ran and passed
    (0 errors over skipped tests checks nothing); fail: memcheck reported an error; inconclusive: the tool
    refused the machine, or the run under it failed or skipped without a memcheck error."""
    summaries = [int(n) for n in _SUMMARY.findall(run.output)]
    figures = {"processes_checked": len(summaries), "errors": sum(summaries)}
    refused = [marker for marker in _REFUSED if marker in run.output]
    if any(summaries):
        return Verdict(Status.FAIL, figures, "memcheck reported errors:\n" + _first_report(run.output))
    if refused or not summaries:
        why = refused or "no summary"
        return Verdict(Status.INCONCLUSIVE, figures,
                       f"compute-sanitizer did not check the run ({why}):\n{tail(run.output, 2000)}")
    if run.returncode != 0:
        return Verdict(Status.INCONCLUSIVE, figures, f"no memcheck error, but the run failed under the tool (exit "
                                                     f"{run.returncode}):\n{tail(run.output, 2000)}")
    tests = pytest_verdict(run)
    figures["tests"] = tests.figures
    if tests.status != Status.PASS:
        return Verdict(Status.INCONCLUSIVE, figures, f"0 memcheck errors, but the tests under it did not all run and "
                                                     f"pass ({tests.status.text}): {tests.error}")
    return Verdict(Status.PASS, figures)


def _first_report(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("=========")]
    return "\n".join(lines[:40])
