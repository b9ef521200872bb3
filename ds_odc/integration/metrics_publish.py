"""Where the step recorder's figures go after a step: DeepSpeed's monitor and the timeline trace.

After each boundary ``engine.step()`` (:mod:`ds_odc.integration.metrics_hooks` calls :meth:`Publisher.after_step`
on every rank, once the step has returned):

* **monitor**: when the ds_config enables one of DeepSpeed's monitors (its ``tensorboard`` / ``wandb`` /
  ``comet`` / ``csv_monitor`` block: ``engine.monitor.enabled``, the same on every rank), every ``interval``
  steps each rank reduces its steps since the last write to one row (:func:`ds_odc.metrics.figures.rank_row`),
  the ranks exchange their rows once (:func:`exchange_columns`), and rank 0 writes the ``ODC/...`` figures
  through ``engine.monitor.write_events`` at ``engine.global_steps``; it also feeds the plan-gap warning
  (:mod:`ds_odc.metrics.plan_gap`).
* **timeline**: after each step ``odc.timeline.steps`` chooses, every rank's spans of that step reach rank 0 in
  one ``torch.distributed.gather_object``, and rank 0 rewrites the trace (:mod:`ds_odc.metrics.trace`).

[Note: the figures' exchange]
Figures of every rank reach rank 0 in one exchange per written step, after the step (never inside forward or
backward). On an ODC training engine it is ``engine.odc_exchange``, a round of the step protocol outside a step
(a rank that died is named within ``timeout_s``), carrying :data:`~ds_odc.runtime.core.VALUES_WIDTH` values per
rank: the fields of a job without several nodes, the split policy or activation offload fit one round; with them
a row takes two rounds. Elsewhere (ZeRO-3 under ``ds_odc.metrics.attach``) it is one ``torch.distributed``
all-gather of the row.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from deepspeed.utils import logger

from ds_odc.metrics import recorder as recorder_module
from ds_odc.metrics.figures import Window, fields_for, figures, rank_row
from ds_odc.metrics.plan_gap import PlanGap
from ds_odc.metrics.recorder import StepRecorder
from ds_odc.metrics.trace import chrome_trace, to_record, write_trace


def job_fields(engine) -> list[str]:
    """The fields every rank of ``engine``'s job contributes (decided from its config: the same everywhere)."""
    if not getattr(engine, "odc_trains", False):
        return fields_for(fenced=False, bytes_counted=False)
    runtime = engine.optimizer.odc
    return fields_for(fenced=True, cross_node=runtime.link.node_count > 1,
                      split=getattr(engine, "odc_split_limits", None) is not None,
                      offload=getattr(engine, "odc_activation_offload", None) is not None)


def _world() -> tuple[int, int]:
    import torch.distributed as tdist

    if not tdist.is_available() or not tdist.is_initialized():
        return 0, 1
    return tdist.get_rank(), tdist.get_world_size()


def exchange_columns(engine, names: list[str], row: list[float], exchange=None) -> dict[str, list[float]]:
    """Every rank's ``row`` (values of ``names``) as columns ``{name: [rank 0's, rank 1's, ...]}``. Collective:
    every rank calls it at the same point ([Note: the figures' exchange]). ``exchange(values, what)``: a
    width-limited exchange to use instead (the Trainer's ``gather_rows``)."""
    rows = _rows(engine, torch.tensor(row, dtype=torch.float64), exchange)
    return {name: [float(v) for v in rows[:, i].tolist()] for i, name in enumerate(names)}


def _rows(engine, values: torch.Tensor, exchange) -> torch.Tensor:
    if _world()[1] == 1:
        return values.reshape(1, -1)
    if exchange is None and getattr(engine, "odc_trains", False):
        exchange = engine.odc_exchange
    if exchange is not None:
        from ds_odc.runtime.core import VALUES_WIDTH

        parts = [exchange(chunk, "the ODC figures") for chunk in values.split(VALUES_WIDTH)]
        return torch.cat([p.to("cpu", torch.float64) for p in parts], dim=1)
    import torch.distributed as tdist

    device = getattr(engine, "device", "cpu") if tdist.get_backend() == "nccl" else "cpu"
    mine = values.to(device)
    gathered = [torch.empty_like(mine) for _ in range(tdist.get_world_size())]
    with torch.profiler.record_function("ds_odc::metrics all_gather"):
        tdist.all_gather(gathered, mine)
    return torch.stack([g.cpu() for g in gathered])


class Publisher:
    """One engine's writers (see the module docstring); ``after_step`` on every rank after each boundary step."""

    def __init__(self, engine, recorder: StepRecorder, interval: int, timeline=None):
        self.engine, self.recorder = engine, recorder
        self.interval = max(1, int(interval))
        monitor = getattr(engine, "monitor", None)
        self.monitor = monitor if getattr(monitor, "enabled", False) else None
        self.fields = job_fields(engine) if self.monitor is not None else []
        self.window = Window()
        self.gap = PlanGap()
        self.timeline = timeline
        self._traced: dict[int, list] = {}

    @property
    def active(self) -> bool:
        return self.monitor is not None or self.timeline is not None

    def after_step(self) -> None:
        if not self.recorder.enabled or self.recorder.last is None:
            return
        step = int(self.engine.global_steps)
        with self.recorder.paused():  # the exchange's round is charged to no step
            if self.monitor is not None and step % self.interval == 0:
                self.write_monitor(step)
            if self.timeline is not None and step in self.timeline.steps:
                self.trace(step)

    # -- the monitor ------------------------------------------------------------------------------------------
    def write_monitor(self, step: int) -> None:
        reports = self.window.take(self.recorder)
        columns = exchange_columns(self.engine, self.fields, rank_row(reports, self.fields))
        if _world()[0] != 0:
            return
        shown = figures(columns, reports)
        assert self.monitor is not None
        self.monitor.write_events([(name, value, step) for name, value in shown.items()])
        warn_on_gap(self.gap, shown)

    # -- the timeline -----------------------------------------------------------------------------------------
    def trace(self, step: int) -> None:
        import torch.distributed as tdist

        offset = time.time() - recorder_module._clock()  # this rank's clock onto the Unix epoch
        last = self.recorder.last
        assert last is not None
        record = to_record(last, step, offset)
        rank, world = _world()
        records = [record]
        if world > 1:
            gathered: Optional[list] = [None] * world if rank == 0 else None
            tdist.gather_object(record, gathered, dst=0)
            records = list(gathered or [])
        if rank != 0:
            return
        self._traced[step] = records
        write_trace(self.timeline.path, chrome_trace(self._traced, label="ODC"))


def warn_on_gap(gap: PlanGap, shown: dict) -> None:
    """Feed the plan-gap warning with one write's figures (rank 0), and give it when due."""
    predicted, measured = shown.get("ODC/plan/balance"), shown.get("ODC/balance")
    if predicted is None or measured is None:
        return
    message = gap.observe(predicted, measured)
    if message is not None:
        logger.warning(message)
