"""Per-rank busy/idle timelines, one panel per run, on a shared time axis (matplotlib PNG).

The picture the product is about: under a collective engine the light rank's lane is full of
waits inside forward/backward; under ODC it finishes its micro-batches and waits once, at the step.
On a GPU the pulls and pushes themselves (side-stream work, ``StepRecorder.device_span``) are drawn as
thin bars under each rank's lane, so their overlap with compute is visible.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ds_odc.errors import ODCError
from ds_odc.metrics.step_report import StepReport, utilisation

COLOURS = {"compute": "#2e7d32", "gather": "#f9a825", "reduce": "#ef6c00", "step_wait": "#c62828",
           "optimizer": "#1565c0", "pull": "#8d6e63", "push": "#6a1b9a"}
LABELS = {"compute": "compute", "gather": "pull / all-gather", "reduce": "push / reduce-scatter",
          "step_wait": "step sync wait", "optimizer": "optimizer", "pull": "pull (side stream)",
          "push": "push (side stream)"}
#: side-stream kinds: drawn below the lane at (offset, height); lanes are then PITCH_WITH_DEVICE apart
DEVICE_BARS = {"pull": (0.47, 0.15), "push": (0.66, 0.15)}
PITCH_WITH_DEVICE = 1.5


def plot_timelines(runs: Mapping[str, Sequence[StepReport]], path: str, title: str = "") -> str:
    """Write a PNG with one panel per entry of ``runs`` (label -> reports of every rank for the
    steps to show). Time 0 is each run's first step start; the axis is shared so lengths compare."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - matplotlib ships with the test/bench extras
        raise ODCError("plot_timelines needs matplotlib: pip install 'ds_odc[bench]'") from error
    if not runs or any(not reports for reports in runs.values()):
        raise ODCError("plot_timelines: every run needs at least one step report")
    figure, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                                figsize=(11, 1.2 + 0.9 * sum(_ranks(r) for r in runs.values())))
    for axis, (label, reports) in zip(axes[:, 0], runs.items()):
        origin = min(r.start for r in reports)
        ranks = sorted({r.rank for r in reports})
        device = any(e[0] in DEVICE_BARS for r in reports for e in r.events)
        pitch = PITCH_WITH_DEVICE if device else 1.0
        for index, rank in enumerate(ranks):
            lane = index * pitch
            events = [e for r in reports if r.rank == rank for e in r.events]
            # enclosing spans (micro-batches, the step) first, the waits inside them drawn on top
            events.sort(key=lambda e: {"micro_batch": 0, "optimizer": 1}.get(e[0], 2))
            for kind, start, end in events:
                colour = COLOURS["compute" if kind == "micro_batch" else kind]
                if kind in DEVICE_BARS:
                    offset, height = DEVICE_BARS[kind]
                    axis.broken_barh([(start - origin, end - start)], (lane + offset, height), facecolors=colour)
                    continue
                height = 0.8 if kind in ("micro_batch", "optimizer") else 0.5
                axis.broken_barh([(start - origin, end - start)], (lane - height / 2, height), facecolors=colour,
                                 edgecolor="white" if kind == "micro_batch" else "none", linewidth=0.6)
        axis.set_yticks([i * pitch for i in range(len(ranks))], [f"rank {r}" for r in ranks])
        axis.set_ylim(-0.7, (len(ranks) - 1) * pitch + (0.95 if device else 0.7))
        axis.invert_yaxis()
        steps = len({r.step for r in reports})
        axis.set_title(f"{label}: {steps} steps, utilisation {100 * utilisation(reports):.1f}%", loc="left",
                       fontsize=10)
    axes[-1, 0].set_xlabel("seconds")
    shown = {e[0] for reports in runs.values() for r in reports for e in r.events}
    kinds = [k for k in COLOURS if k not in DEVICE_BARS or k in shown]
    figure.legend(handles=[Patch(color=COLOURS[k], label=LABELS[k]) for k in kinds], loc="lower center",
                  ncol=len(kinds), fontsize=8, frameon=False)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _ranks(reports: Sequence[StepReport]) -> int:
    return len({r.rank for r in reports})
