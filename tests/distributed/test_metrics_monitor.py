"""The ODC figures where users already look: DeepSpeed's monitors (TensorBoard and CSV files, read back), the HF
Trainer's logs and its TensorBoard events, and the timeline trace; on 2 CPU ranks running uneven micro-batch
counts (4 for the split policy), and the same names from a ZeRO-3 engine under ``ds_odc.metrics.attach``."""
import collections
import csv
import glob
import json
import os

import pytest

from ds_odc.metrics.figures import MEANINGS, PREFIX
from ds_odc.metrics.step_report import balance, utilisation
from tests.support.harness import run_ranks
from tests.support.metrics_workloads import PLAN, monitored_run

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

COUNTS = (1, 3)
STEPS = 3
TIMELINE_STEPS = [2, 3]
#: what a job without several nodes, the split policy or activation offload writes on ODC
ODC_FIGURES = {f"{PREFIX}{name}" for name in MEANINGS if not name.startswith(("cross_node", "split", "activation"))}
#: on ZeRO-3: no bytes are counted, and no plan was noted in its run
ZERO3_FIGURES = {name for name in ODC_FIGURES if "bytes" not in name and "/plan/" not in name}


def scalars(log_dir: str) -> dict:
    """tag -> [(step, value)] of every TensorBoard event file under ``log_dir``."""
    out = {}
    for directory in sorted({os.path.dirname(p) for p in glob.glob(f"{log_dir}/**/events.out.tfevents.*",
                                                                   recursive=True)}):
        accumulator = EventAccumulator(directory, size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return out


def csv_figures(directory: str) -> dict:
    """tag -> [(step, value)] of DeepSpeed's CSV monitor (one file per tag, '/' written as '_')."""
    out = {}
    for path in glob.glob(os.path.join(directory, "*.csv")):
        with open(path) as file:
            rows = list(csv.reader(file))
        out[os.path.basename(path)[:-4]] = [(int(step), float(value)) for step, value in rows[1:]]
    return out


@pytest.fixture(scope="module")
def odc(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("odc_monitor"))
    timeline = {"path": os.path.join(root, "trace", "timeline.json"), "steps": TIMELINE_STEPS}
    ranks = run_ranks(monitored_run, 2, "odc", root, COUNTS, STEPS, 0, timeline, timeout=300)
    return root, ranks


def test_an_odc_engine_writes_every_ranks_figures_through_deepspeeds_monitors(odc):
    root, ranks = odc
    assert [r["engine"] for r in ranks] == ["ODCEngine"] * 2 and ranks[0]["global_steps"] == [1, 2, 3]
    written = scalars(os.path.join(root, "tb"))
    figures = {tag: points for tag, points in written.items() if tag.startswith(PREFIX)}
    assert set(figures) == ODC_FIGURES
    assert "Train/Samples/lr" in written  # DeepSpeed's own figures are still written
    assert all([step for step, _ in points] == [1, 2, 3] for points in figures.values())
    # the CSV monitor holds the same figures, at the same steps (TensorBoard keeps float32)
    in_csv = csv_figures(os.path.join(root, "csv", "job"))
    for tag, points in figures.items():
        assert [s for s, _ in in_csv[tag.replace("/", "_")]] == [1, 2, 3]
        assert [v for _, v in points] == pytest.approx([v for _, v in in_csv[tag.replace("/", "_")]], rel=1e-6)
    # each figure is what the ranks' own reports say about that step
    for index, step in enumerate([1, 2, 3]):
        mine, theirs = (r["reports"][index] for r in ranks)
        value = {tag: dict(points)[step] for tag, points in figures.items()}
        assert (value[PREFIX + "micro_batches/min"], value[PREFIX + "micro_batches/max"]) == COUNTS
        assert (value[PREFIX + "tokens/min"], value[PREFIX + "tokens/max"]) == (4 * COUNTS[0], 4 * COUNTS[1])
        util = [mine.utilisation, theirs.utilisation]
        assert value[PREFIX + "utilisation/min"] == pytest.approx(min(util), rel=1e-6)
        assert value[PREFIX + "utilisation/mean"] == pytest.approx(sum(util) / 2, rel=1e-6)
        assert value[PREFIX + "idle_fraction"] == pytest.approx(1 - sum(util) / 2, rel=1e-5)
        assert value[PREFIX + "step_s"] == pytest.approx(mine.wall_s, rel=1e-6)
        compute = [sum(mine.compute_s), sum(theirs.compute_s)]
        assert value[PREFIX + "balance"] == pytest.approx(balance(compute), rel=1e-6)
        assert value[PREFIX + "compute/max_s"] == pytest.approx(max(compute), rel=1e-6)
        assert value[PREFIX + "fence_wait/max_s"] == pytest.approx(max(mine.step_wait_s, theirs.step_wait_s),
                                                                   rel=1e-6)
        assert value[PREFIX + "pull/max_s"] == pytest.approx(max(mine.gather_s, theirs.gather_s), rel=1e-6)
        assert value[PREFIX + "plan/balance"] == pytest.approx(PLAN.balance) and \
            value[PREFIX + "plan/step_cost"] == PLAN.step_cost
        # every micro-batch pushes every gradient once: rank 1 pushes three times rank 0's bytes
        push = [mine.counter("push_bytes"), theirs.counter("push_bytes")]
        assert push[1] == 3 * push[0] > 0
        assert value[PREFIX + "push/max_bytes"] == push[1] and value[PREFIX + "push/mean_bytes"] == sum(push) / 2
        assert value[PREFIX + "pull/mean_bytes"] > 0


def test_the_monitor_writes_every_interval_the_steps_since_the_last_write(tmp_path):
    ranks = run_ranks(monitored_run, 2, "odc", str(tmp_path), COUNTS, 4, 2, None, False, timeout=300)
    figures = {tag: points for tag, points in scalars(str(tmp_path / "tb")).items() if tag.startswith(PREFIX)}
    assert set(figures) == {name for name in ODC_FIGURES if "/plan/" not in name}  # no plan noted this time
    assert all([step for step, _ in points] == [2, 4] for points in figures.values())
    for window, step in (([0, 1], 2), ([2, 3], 4)):
        per_rank = [[r["reports"][i] for i in window] for r in ranks]
        value = {tag: dict(points)[step] for tag, points in figures.items()}
        assert value[PREFIX + "utilisation/min"] == pytest.approx(min(utilisation(w) for w in per_rank), rel=1e-6)
        assert value[PREFIX + "step_s"] == pytest.approx(sum(r.wall_s for r in per_rank[0]) / 2, rel=1e-6)
        assert (value[PREFIX + "micro_batches/min"], value[PREFIX + "micro_batches/max"]) == COUNTS  # per step


def test_activation_offload_adds_its_bytes_and_a_row_wider_than_one_round_still_arrives_whole(tmp_path):
    """With activation offload a row carries 9 fields: two exchange rounds of at most 8 values."""
    from ds_odc.metrics.figures import fields_for
    from ds_odc.runtime.core import VALUES_WIDTH

    assert len(fields_for(fenced=True, offload=True)) > VALUES_WIDTH
    extra = {"activation_offload": {"budget_mb": 0}}
    ranks = run_ranks(monitored_run, 2, "odc", str(tmp_path), COUNTS, 2, 0, None, True, extra, timeout=300)
    figures = {tag: points for tag, points in scalars(str(tmp_path / "tb")).items() if tag.startswith(PREFIX)}
    assert set(figures) == ODC_FIGURES | {PREFIX + "activation_offload/mean_bytes",
                                          PREFIX + "activation_offload/max_bytes"}
    for index, step in enumerate([1, 2]):
        mine, theirs = (r["reports"][index] for r in ranks)
        value = {tag: dict(points)[step] for tag, points in figures.items()}
        moved = [mine.counter("offload_bytes"), theirs.counter("offload_bytes")]
        assert moved[1] > moved[0] > 0  # three micro-batches offload more than one
        assert value[PREFIX + "activation_offload/max_bytes"] == moved[1]
        assert value[PREFIX + "activation_offload/mean_bytes"] == sum(moved) / 2
        # the fields of the first round and of the second, each from the right rank
        assert (value[PREFIX + "micro_batches/min"], value[PREFIX + "micro_batches/max"]) == COUNTS
        assert value[PREFIX + "utilisation/min"] == pytest.approx(min(mine.utilisation, theirs.utilisation), rel=1e-6)
        assert value[PREFIX + "push/max_bytes"] == theirs.counter("push_bytes")


def test_split_micro_batches_are_counted_and_timed_per_rank(tmp_path):
    """The split policy on 4 CPU ranks: each rank's split micro-batches per step, as its plan gives them, and the
    plan's prediction from a SplitPlan; a row of 10 fields (two rounds)."""
    pytest.importorskip("transformers")
    from tests.support.metrics_workloads import monitored_split_run

    ranks = run_ranks(monitored_split_run, 4, str(tmp_path), 2, timeout=400)
    written = {tag: points for tag, points in csv_figures(str(tmp_path / "csv" / "job")).items()
               if tag.startswith("ODC_")}  # DeepSpeed's own are written at global_samples
    for name in ("split/micro_batches/min", "split/micro_batches/max", "split/mean_s", "split/max_s"):
        assert [s for s, _ in written[f"ODC_{name.replace('/', '_')}"]] == [1, 2], name
    for index, step in enumerate([1, 2]):
        value = {tag: dict(points)[step] for tag, points in written.items()}
        entries = [r["split_entries"][index] for r in ranks]
        assert (value["ODC_split_micro_batches_min"], value["ODC_split_micro_batches_max"]) == (min(entries),
                                                                                                max(entries))
        assert max(entries) > 0 and value["ODC_split_max_s"] == pytest.approx(
            max(r["reports"][index].counter("split_s") for r in ranks), rel=1e-9)
        plan = ranks[0]["plans"][index]
        assert value["ODC_plan_balance"] == pytest.approx(plan.balance) and \
            value["ODC_plan_step_cost"] == pytest.approx(plan.step_cost)
        counts = [r["reports"][index].micro_batches for r in ranks]
        assert (value["ODC_micro_batches_min"], value["ODC_micro_batches_max"]) == (min(counts), max(counts))


def test_a_zero3_engine_under_attach_writes_the_same_names(tmp_path):
    ranks = run_ranks(monitored_run, 2, 3, str(tmp_path), (2, 2), 2, 0, None, False, timeout=300)
    assert ranks[0]["engine"] == "DeepSpeedEngine"
    figures = {tag: points for tag, points in scalars(str(tmp_path / "tb")).items() if tag.startswith(PREFIX)}
    assert set(figures) == ZERO3_FIGURES
    for index, step in enumerate([1, 2]):
        value = {tag: dict(points)[step] for tag, points in figures.items()}
        assert value[PREFIX + "micro_batches/min"] == value[PREFIX + "micro_batches/max"] == 2
        assert value[PREFIX + "tokens/max"] == 8
        reports = [r["reports"][index] for r in ranks]
        assert value[PREFIX + "pull/max_s"] == pytest.approx(max(r.gather_s for r in reports), rel=1e-6)
        assert value[PREFIX + "utilisation/min"] == pytest.approx(min(r.utilisation for r in reports), rel=1e-6)


def test_the_timeline_holds_every_ranks_spans_of_the_chosen_steps_and_draws(odc, tmp_path):
    root, ranks = odc
    path = os.path.join(root, "trace", "timeline.json")
    with open(path) as file:
        trace = json.load(file)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["step"] for e in spans} == set(TIMELINE_STEPS)  # step 1 was not chosen
    assert {e["pid"] for e in spans} == {0, 1}
    counted = collections.Counter((e["pid"], e["args"]["step"], e["cat"]) for e in spans)
    expected = collections.Counter((rank, step, kind) for rank, result in enumerate(ranks) for step in TIMELINE_STEPS
                                   for kind, _, _ in result["reports"][step - 1].events)
    assert counted == expected  # one event per span
    for rank, result in enumerate(ranks):
        for step in TIMELINE_STEPS:
            report = result["reports"][step - 1]
            mine = sorted((e for e in spans if e["pid"] == rank and e["args"]["step"] == step), key=lambda e: e["ts"])
            assert sum(e["cat"] == "micro_batch" for e in mine) == COUNTS[rank]
            # on the epoch clock a float64 holds about half a microsecond
            assert sorted(e["dur"] for e in mine) == pytest.approx(
                sorted((end - start) * 1e6 for _, start, end in report.events), abs=1.0)
    from ds_odc.__main__ import main

    png = tmp_path / "timeline.png"
    assert main(["timeline", path, "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


LB_MINI = {"policy": "lb-mini", "token_cap": 48, "cost_model": {"a": 0.02, "b": 1.0}}


def test_an_odc_trainer_logs_the_figures_and_reports_them_to_tensorboard(tmp_path):
    pytest.importorskip("transformers")
    from tests.support.metrics_workloads import trainer_run

    ranks = run_ranks(trainer_run, 2, "odc", str(tmp_path), LB_MINI, 3, 1, timeout=300)
    history = [entry for entry in ranks[0]["log_history"] if "loss" in entry]
    assert [entry["step"] for entry in history] == [1, 2, 3]
    for entry in history:
        assert {name for name in entry if name.startswith(PREFIX)} == ODC_FIGURES
        assert 0 < entry[PREFIX + "plan/balance"] <= 1 and 0 < entry[PREFIX + "utilisation/min"] <= 1
        assert entry["odc_micro_batches"].count("/") == 1  # the balance block's own keys stay
    written = scalars(str(tmp_path / "runs"))
    for name in ODC_FIGURES:
        assert [s for s, _ in written[f"train/{name}"]] == [1, 2, 3]
        assert [v for _, v in written[f"train/{name}"]] == pytest.approx([e[name] for e in history], rel=1e-5)
    # the logged counts are what each rank's recorder saw
    for entry, mine, theirs in zip(history, ranks[0]["reports"], ranks[1]["reports"]):
        counts = [mine.micro_batches, theirs.micro_batches]
        assert (entry[PREFIX + "micro_batches/min"], entry[PREFIX + "micro_batches/max"]) == (min(counts),
                                                                                              max(counts))


def test_a_zero3_trainer_logs_no_odc_key(tmp_path):
    pytest.importorskip("transformers")
    from tests.support.metrics_workloads import trainer_run

    ranks = run_ranks(trainer_run, 2, 3, str(tmp_path), None, 2, 1, timeout=300)
    assert ranks[0]["engine"] == "DeepSpeedEngine"
    keys = {key for rank in ranks for entry in rank["log_history"] for key in entry}
    assert "loss" in keys and not [key for key in keys if key.startswith((PREFIX, "odc"))]
    assert not [tag for tag in scalars(str(tmp_path / "runs")) if "ODC" in tag or "odc" in tag]
