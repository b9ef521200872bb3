"""The ODC figures in a Hugging Face Trainer's logs: ``log``, bound on every Trainer that asks for ODC.

At each training log (``logging_steps``; the logs that carry ``"loss"``; every rank logs at the same steps), the
Trainer's ``log`` adds the ``ODC/...`` figures of :mod:`ds_odc.metrics.figures` over the steps since the last log,
so ``trainer.state.log_history`` holds them and every ``report_to`` integration (TensorBoard, W&B, ...) shows
them, as ``train/ODC/...``, with no user code. The ranks' rows meet in one exchange per log
(:func:`~ds_odc.integration.hf_gather.gather_rows`, an ODC round: [Note: the figures' exchange] in
:mod:`ds_odc.integration.metrics_publish`); rank 0 feeds the plan-gap warning.

With the balance block the plan is noted on the engine's recorder at each slot (``hf_balance``), so
``ODC/plan/balance`` and ``ODC/plan/step_cost`` come too, and the keys the balance block has always logged:
``odc_micro_batches`` (each rank's count in the last step, ``"2/3"``), ``odc_planned_utilisation``,
``odc_utilisation`` and ``odc_utilisation_per_rank`` (over the steps since the last log).

Bound by :func:`ds_odc.integration.hf_trainer.bind_if_odc` on that Trainer instance only (``TrainerFigures.log``,
its state in the Trainer's ``_ds_odc_figures``): a Trainer whose config does not ask for ODC logs exactly what
transformers logs.
"""
from __future__ import annotations

import dataclasses

from ds_odc.integration.hf_balance import balance_state
from ds_odc.integration.hf_gather import gather_rows
from ds_odc.integration.metrics_publish import exchange_columns, job_fields, warn_on_gap
from ds_odc.metrics.figures import Window, figures, rank_row
from ds_odc.metrics.plan_gap import PlanGap

#: The one attribute a bound Trainer carries for its figures.
STATE_ATTRIBUTE = "_ds_odc_figures"


@dataclasses.dataclass
class TrainerFigures:
    """The log behaviour of one Trainer and what it keeps between logs."""

    window: Window = dataclasses.field(default_factory=Window)
    gap: PlanGap = dataclasses.field(default_factory=PlanGap)

    def log(self, original, trainer, logs, *args, **kwargs):
        if "loss" in logs:
            logs = {**logs, **self.figures(trainer)}
        return original(trainer, logs, *args, **kwargs)

    def figures(self, trainer) -> dict:
        """The figures over the steps since the last log (collective: every rank calls it at the same log)."""
        engine = getattr(trainer, "deepspeed", None)
        recorder = getattr(engine, "odc_metrics", None)
        if recorder is None or not getattr(engine, "odc_trains", False):
            return {}  # every rank alike: the same config, the same engine
        reports = self.window.take(recorder)
        if not reports:
            return {}  # every rank has run the same steps
        names = job_fields(engine)
        with recorder.paused():  # the exchange's round is charged to no step
            columns = exchange_columns(engine, names, rank_row(reports, names),
                                       exchange=lambda values, what: gather_rows(trainer, values, what))
        shown: dict[str, float | str] = {name: round(value, 6) for name, value in figures(columns, reports).items()}
        if trainer.is_world_process_zero():
            warn_on_gap(self.gap, shown)
        state = balance_state(trainer)
        header = state.last_header if state is not None else None
        if header is not None:
            utilisation = columns["utilisation"]
            shown["odc_micro_batches"] = "/".join(str(c) for c in header.micro_batch_counts)
            shown["odc_planned_utilisation"] = round(header.planned_utilisation, 4)
            shown["odc_utilisation"] = round(sum(utilisation) / len(utilisation), 4)
            shown["odc_utilisation_per_rank"] = "/".join(f"{u:.3f}" for u in utilisation)
        return shown
