"""Step timelines as a Chrome / Perfetto trace: the JSON format PyTorch's profiler writes, so the file opens in
Perfetto (ui.perfetto.dev) or ``chrome://tracing`` beside a torch profile.

One complete event (``"ph": "X"``) per recorded span, ``ts`` and ``dur`` in microseconds; ``pid`` is the rank
(named ``rank r`` by a metadata event), ``tid`` 0 the rank's own work (micro-batches, with the pulls, pushes and
step waits charged inside them nested under them, and the optimizer step with its rounds), ``tid`` 1 the pull
and push work of side streams (GPU). ``cat`` is the recorder's kind, ``args`` hold the step and the rank. Times
are on the Unix epoch (each rank converts its own clock, so the ranks of several hosts line up as far as their
clocks agree). The top-level ``"ds_odc"`` block carries each (rank, step)'s totals, from which
:func:`read_trace` rebuilds the step reports that :func:`ds_odc.metrics.plot_timelines` draws
(``python -m ds_odc timeline TRACE -o timeline.png``).

>>> from ds_odc.metrics.step_report import StepReport
>>> r = StepReport(rank=1, step=0, start=10.0, wall_s=2.0, compute_s=(1.0,), gather_s=0.5, reduce_s=0.0,
...                step_wait_s=0.25, optimizer_s=0.25, events=(("micro_batch", 10.0, 11.5), ("gather", 10.5, 11.0),
...                ("optimizer", 11.5, 12.0), ("step_wait", 11.5, 11.75)))
>>> trace = chrome_trace({7: [to_record(r, 7, offset_s=0.0)]}, label="ODC")
>>> [(e["name"], e["ts"], e["dur"], e["pid"]) for e in trace["traceEvents"] if e["ph"] == "X"][:2]
[('micro-batch', 10000000.0, 1500000.0, 1), ('pull', 10500000.0, 500000.0, 1)]
>>> import dataclasses
>>> read_reports(trace)[0] == dataclasses.replace(r, step=7)
True
"""
from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

from ds_odc.errors import ODCError
from ds_odc.metrics.step_report import StepReport

#: Event names by the recorder's kind (ODC's words; on ZeRO-3 a pull is an all-gather, a push a reduce-scatter).
NAMES = {"micro_batch": "micro-batch", "gather": "pull", "reduce": "push", "step_wait": "step wait",
         "optimizer": "optimizer", "pull": "pull (side stream)", "push": "push (side stream)"}
SIDE_STREAM_KINDS = ("pull", "push")
_TOTALS = ("start", "wall_s", "compute_s", "gather_s", "reduce_s", "step_wait_s", "optimizer_s", "timing")
FORMAT = 1


def to_record(report: StepReport, step: int, offset_s: float) -> dict:
    """A picklable, JSON-ready record of ``report`` as optimizer step ``step``, its times moved by ``offset_s``
    (the rank's clock onto the Unix epoch)."""
    return {"rank": report.rank, "step": step, "start": report.start + offset_s, "wall_s": report.wall_s,
            "compute_s": list(report.compute_s), "gather_s": report.gather_s, "reduce_s": report.reduce_s,
            "step_wait_s": report.step_wait_s, "optimizer_s": report.optimizer_s, "timing": report.timing,
            "events": [[kind, start + offset_s, end + offset_s] for kind, start, end in report.events]}


def chrome_trace(records_by_step: Mapping[int, Sequence[dict]], label: str = "ODC") -> dict:
    """The trace of the given steps (step -> every rank's :func:`to_record`)."""
    events: list[dict] = []
    ranks = sorted({rec["rank"] for records in records_by_step.values() for rec in records})
    for rank in ranks:
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "work"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "side streams"}})
    totals = []
    for step in sorted(records_by_step):
        for rec in sorted(records_by_step[step], key=lambda r: r["rank"]):
            totals.append({"rank": rec["rank"], "step": step, **{key: rec[key] for key in _TOTALS}})
            for kind, start, end in rec["events"]:
                events.append({"name": NAMES.get(kind, kind), "cat": kind, "ph": "X", "pid": rec["rank"],
                               "tid": 1 if kind in SIDE_STREAM_KINDS else 0, "ts": _us(start), "dur": _us(end - start),
                               "args": {"step": step, "rank": rec["rank"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "ds_odc": {"format": FORMAT, "label": label, "clock": "unix epoch", "steps": totals}}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def write_trace(path: str, trace: dict) -> str:
    """Write ``trace`` to ``path`` (its directory created), atomically: a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w") as out:
        json.dump(trace, out)
    os.replace(partial, path)
    return path


def read_reports(trace: dict) -> list[StepReport]:
    """The step reports of a trace :func:`chrome_trace` made (events rebuilt from its complete events)."""
    block = trace.get("ds_odc") if isinstance(trace, dict) else None
    if not isinstance(block, dict) or "steps" not in block:
        raise ODCError("not a ds_odc timeline: the trace has no \"ds_odc\" block (write one with the odc stage's "
                       "\"timeline\" option)")
    spans: dict[tuple[int, int], list] = {}
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and "step" in event.get("args", {}):
            start = event["ts"] / 1e6
            spans.setdefault((event["pid"], event["args"]["step"]), []).append(
                (event["cat"], start, start + event["dur"] / 1e6))
    reports = []
    for totals in block["steps"]:
        rank, step = totals["rank"], totals["step"]
        fields = {key: totals[key] for key in _TOTALS}
        fields["compute_s"] = tuple(fields["compute_s"])
        reports.append(StepReport(rank=rank, step=step, events=tuple(spans.get((rank, step), ())), **fields))
    return reports


def read_trace(path: str) -> tuple[str, list[StepReport]]:
    """The label (e.g. "ODC") and the step reports of the trace file at ``path``."""
    with open(path) as file:
        trace = json.load(file)
    reports = read_reports(trace)
    return str(trace["ds_odc"].get("label", os.path.basename(path))), reports
