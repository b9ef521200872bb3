"""Per-rank step timelines and utilisation, for ODC and ZeRO-3 engines alike.

ODC engines record by default (``zero_optimization.odc.metrics``); ``engine.odc_metrics`` is the
:class:`StepRecorder`, ``engine.odc_metrics.last`` the last step's :class:`StepReport`. Any other
DeepSpeed engine (ZeRO-3 for a side-by-side comparison) records after ``attach(engine)``. With one of DeepSpeed's
monitors enabled in the ds_config, both write the ``ODC/...`` figures (:mod:`ds_odc.metrics.figures`) through it.
"""
from ds_odc.metrics.recorder import StepRecorder
from ds_odc.metrics.step_report import PlannedStep, StepReport, step_line, utilisation


def attach(engine, log_interval: int = 0) -> StepRecorder:
    """Record ``engine``'s steps (any ``DeepSpeedEngine``; call it on every rank); log a line every
    ``log_interval`` steps. With a DeepSpeed monitor enabled, write the figures every ``log_interval`` steps
    (every step when 0)."""
    from ds_odc.integration.metrics_hooks import attach_recorder
    return attach_recorder(engine, log_interval)


def planned_step(plan) -> PlannedStep:
    """The prediction of a balance plan: a ``Plan`` (``plan_minibatch``), a ``SplitPlan`` (``plan_split``), a
    Trainer slot's ``StepHeader``, or a :class:`PlannedStep`."""
    if isinstance(plan, PlannedStep):
        return plan
    costs = plan.rank_costs() if callable(plan.rank_costs) else plan.rank_costs
    if hasattr(plan, "odc_cost"):  # StepHeader
        step = plan.odc_cost
    elif hasattr(plan, "odc_step_cost"):  # Plan
        step = plan.odc_step_cost()
    else:  # SplitPlan
        step = plan.step_cost()
    return PlannedStep(tuple(float(c) for c in costs), float(step))


def note_plan(engine, plan) -> None:
    """Tell ``engine``'s recorder what the planner predicted for the step under way (before its ``step()``), so
    the figures compare prediction and measurement (``ODC/plan/...``) and a lasting gap is warned about. The
    Trainer's balance block does it by itself; a loop over ``BalancedBatchSampler`` steps calls it with
    ``sampler.plans()[i][0]``. A no-op on an engine that does not record."""
    recorder = getattr(engine, "odc_metrics", None)
    if recorder is not None:
        recorder.note_plan(planned_step(plan))


def plot_timelines(runs, path, title=""):
    """See :func:`ds_odc.metrics.plot.plot_timelines` (imports matplotlib only when called)."""
    from ds_odc.metrics.plot import plot_timelines as plot
    return plot(runs, path, title)


__all__ = ["PlannedStep", "StepRecorder", "StepReport", "attach", "note_plan", "planned_step", "plot_timelines",
           "step_line", "utilisation"]
