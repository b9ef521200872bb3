"""The timeline as a Chrome / Perfetto trace (ds_odc.metrics.trace), the option that asks for it, and
``python -m ds_odc timeline``."""
import collections
import doctest
import json

import pytest

import ds_odc.metrics.trace
from ds_odc.__main__ import main
from ds_odc.config import parse_options
from ds_odc.errors import ODCConfigError
from ds_odc.metrics import StepReport
from ds_odc.metrics.trace import chrome_trace, read_reports, read_trace, to_record, write_trace

PNG = b"\x89PNG\r\n\x1a\n"


def test_docstring_examples():
    failures, tried = doctest.testmod(ds_odc.metrics.trace)
    assert tried and not failures


def step_report(rank, step, start, micro_batches):
    """A step of ``micro_batches`` one-second micro-batches (a 0.25 s pull in each), then a step wait and the
    optimizer; a side-stream pull on rank 1."""
    events, t = [], start
    for _ in range(micro_batches):
        events += [("micro_batch", t, t + 1.0), ("gather", t + 0.25, t + 0.5)]
        t += 1.0
    if rank == 1:
        events.append(("pull", start + 0.1, start + 0.6))
    events += [("optimizer", t, t + 1.0), ("step_wait", t, t + 0.5)]
    return StepReport(rank=rank, step=step, start=start, wall_s=t + 1.0 - start,
                      compute_s=(0.75,) * micro_batches, gather_s=0.25 * micro_batches, reduce_s=0.0,
                      step_wait_s=0.5, optimizer_s=0.5, events=tuple(events))


@pytest.fixture
def records():
    """Steps 4 and 5 of two ranks (1 and 3 micro-batches), chosen out of steps 3 to 5."""
    out = {}
    for step in (4, 5):
        out[step] = [to_record(step_report(rank, step - 1, 100.0 * step, 1 + 2 * rank), step, offset_s=1000.0)
                     for rank in range(2)]
    return out


def test_the_trace_has_one_complete_event_per_span_of_every_rank_and_only_the_chosen_steps(records):
    trace = json.loads(json.dumps(chrome_trace(records)))  # what a file holds
    assert set(trace) == {"traceEvents", "displayTimeUnit", "ds_odc"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for event in spans:
        assert set(event) == {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}
        assert isinstance(event["ts"], float) and event["dur"] >= 0 and event["tid"] in (0, 1)
        assert event["pid"] == event["args"]["rank"]
    counted = collections.Counter((e["pid"], e["args"]["step"], e["cat"]) for e in spans)
    expected = collections.Counter((rec["rank"], step, kind) for step, recs in records.items() for rec in recs
                                   for kind, _, _ in rec["events"])
    assert counted == expected
    assert {e["args"]["step"] for e in spans} == {4, 5}  # step 3 was not chosen
    assert {e["pid"] for e in spans} == {0, 1}
    side = [e for e in spans if e["tid"] == 1]
    assert [(e["pid"], e["cat"], e["name"]) for e in side] == [(1, "pull", "pull (side stream)")] * 2
    pull = next(e for e in spans if e["cat"] == "gather" and e["pid"] == 0 and e["args"]["step"] == 4)
    assert pull["name"] == "pull" and pull["ts"] == (400.0 + 1000.0 + 0.25) * 1e6 and pull["dur"] == 0.25e6
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert all(e["ph"] in ("X", "M") for e in trace["traceEvents"])


def test_a_trace_reads_back_as_the_step_reports_it_was_made_of(records, tmp_path):
    path = write_trace(str(tmp_path / "deep" / "timeline.json"), chrome_trace(records, label="ODC"))
    label, reports = read_trace(path)
    assert label == "ODC" and len(reports) == 4
    by_key = {(r.rank, r.step): r for r in reports}
    original = step_report(1, 4, 500.0, 3)
    back = by_key[(1, 5)]
    assert back.compute_s == original.compute_s and back.micro_batches == 3
    assert back.utilisation == pytest.approx(original.utilisation)
    assert [(k, round(s - 1000.0, 6), round(e - 1000.0, 6)) for k, s, e in back.events] == list(original.events)
    with pytest.raises(ds_odc.errors.ODCError, match="not a ds_odc timeline"):
        read_reports({"traceEvents": []})


def test_the_command_line_draws_the_png(records, tmp_path, capsys):
    trace = write_trace(str(tmp_path / "timeline.json"), chrome_trace(records))
    other = write_trace(str(tmp_path / "zero3.json"), chrome_trace(records, label="ZeRO-3"))
    out = tmp_path / "timeline.png"
    assert main(["timeline", trace, other, "-o", str(out), "--title", "two runs"]) == 0
    assert out.read_bytes()[:8] == PNG
    assert main(["timeline", str(tmp_path / "missing.json"), "-o", str(out)]) == 1
    (tmp_path / "torch.json").write_text(json.dumps({"traceEvents": []}))
    assert main(["timeline", str(tmp_path / "torch.json"), "-o", str(out)]) == 1
    assert "not a ds_odc timeline" in capsys.readouterr().err


def test_the_option_names_a_path_and_steps_and_needs_the_recorder():
    options = parse_options({"timeline": {"path": "t.json", "steps": [2, 3]}})
    assert options.timeline.path == "t.json" and options.timeline.steps == [2, 3]
    for bad, field in (({"path": "t.json", "steps": [0]}, "timeline.steps.0"),
                       ({"path": "t.json", "steps": []}, "timeline.steps"),
                       ({"path": "", "steps": [1]}, "timeline.path"),
                       ({"steps": [1]}, "timeline.path"),
                       ({"path": "t.json", "steps": [1], "ranks": [0]}, "timeline.ranks")):
        with pytest.raises(ODCConfigError, match=f"zero_optimization.odc.{field}"):
            parse_options({"timeline": bad})
    with pytest.raises(ODCConfigError, match="timeline draws the step recorder's spans"):
        parse_options({"metrics": False, "timeline": {"path": "t.json", "steps": [1]}})
