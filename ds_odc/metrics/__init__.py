"""Per-rank step timelines and utilisation, for ODC and ZeRO-3 engines alike.

ODC engines record by default (``zero_optimization.odc.metrics``); ``engine.odc_metrics`` is the
:class:`StepRecorder`, ``engine.odc_metrics.last`` the last step's :class:`StepReport`. Any other
DeepSpeed engine (ZeRO-3 for a side-by-side comparison) records after ``attach(engine)``.
"""
from ds_odc.metrics.recorder import StepRecorder
from ds_odc.metrics.step_report import StepReport, step_line, utilisation


def attach(engine, log_interval: int = 0) -> StepRecorder:
    """Record ``engine``'s steps (any ``DeepSpeedEngine``); log a line every ``log_interval`` steps."""
    from ds_odc.integration.metrics_hooks import attach_recorder
    return attach_recorder(engine, log_interval)


def plot_timelines(runs, path, title=""):
    """See :func:`ds_odc.metrics.plot.plot_timelines` (imports matplotlib only when called)."""
    from ds_odc.metrics.plot import plot_timelines as plot
    return plot(runs, path, title)


__all__ = ["StepRecorder", "StepReport", "attach", "plot_timelines", "step_line", "utilisation"]
