"""Fit the step model to measured steps, so a held-out error tests the simulator's structure.

A cost model fitted once on bare forward+backward can be off on the day the benchmark runs (a
loaded machine, a term the fit dropped), and an engine adds costs around compute: hooks and
bookkeeping per micro-batch, the optimizer and its synchronisation per step. Comparing raw
predictions with measurements mixes those errors with the one we want to know: is the
*structure* right, "a collective engine pays ``Σ_m max_rank``, ODC pays ``max_rank Σ_m``"?

So this module fits, by non-negative least squares on relative errors, one shared compute cost
(``quadratic·s² + linear·s`` per sample) and per engine a cost per micro-batch (its hooks plus, when
nothing overlaps, its per-micro-batch communication) and a cost per step. Which rank and
micro-batch set each step's time depends on the fit, so the fit alternates: assign the maxima
under the current constants, solve, repeat until the assignment stops changing. Fit on some runs
and predict the others (:func:`held_out_errors`) to state an honest error.

The fitted machine overlaps nothing (``prefetch_depth=0``), as on a CPU where transfers run on the
compute thread; per-layer transfer times are folded into the per-micro-batch cost.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Callable, Sequence

from benchmarks.sim.hardware import Hardware
from benchmarks.sim.projection import ENGINE_SCHEMES, plan_from_record
from benchmarks.sim.timeline import simulate_step
from ds_odc.balance import CostModel, Plan
from ds_odc.balance.cost import nonnegative_least_squares
from ds_odc.errors import ODCError


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Per engine, the cost model and machine that reproduce its measured steps."""

    cost_models: dict
    hardware: dict

    def predict(self, plan: Plan, engine: str) -> float:
        scheme = ENGINE_SCHEMES[engine]
        return simulate_step(plan, self.hardware[engine], scheme, self.cost_models[engine]).step_seconds


def _steps(runs: Sequence[dict], cost_model: CostModel):
    for run in runs:
        if run.get("engine") not in ENGINE_SCHEMES:
            raise ODCError(f"benchmark run engine {run.get('engine')!r} unknown; "
                           f"expected one of {sorted(ENGINE_SCHEMES)}")
        for step, seconds in zip(run["steps"], run["step_seconds"]):
            if seconds > 0:
                plan = plan_from_record(step["lengths"], step["micro_batches"], cost_model)
                yield run["engine"], plan, float(seconds)


def _features(plan: Plan, engine: str, model: CostModel) -> tuple[float, float, float]:
    """(Σ s², Σ s, micro-batches) of whatever sets this step's time under ``model``."""
    batches = [[[plan.lengths[i] for i in batch] for batch in rank] for rank in plan.micro_batches]
    if engine == "odc":
        busiest = max(batches, key=lambda rank: sum(model.micro_batch_cost(b) for b in rank)) if batches else []
        return (float(sum(s * s for b in busiest for s in b)), float(sum(s for b in busiest for s in b)),
                float(len(busiest)))
    depth = max((len(rank) for rank in batches), default=0)
    squares = linear = 0.0
    for m in range(depth):  # a rank past its last micro-batch runs an empty one
        slowest = max((rank[m] if m < len(rank) else [] for rank in batches), key=model.micro_batch_cost)
        squares += sum(s * s for s in slowest)
        linear += sum(slowest)
    return squares, linear, float(depth)


def calibrate(runs: Sequence[dict], cost_model: CostModel, max_rounds: int = 20) -> Calibration:
    """Fit compute (shared) and fixed costs (per engine) to ``runs``; ``cost_model`` is the start."""
    steps = list(_steps(runs, cost_model))
    if not steps:
        raise ODCError("calibrate: no measured steps to fit")
    engines = sorted({engine for engine, _, _ in steps})
    columns = 2 + 2 * len(engines)  # quadratic, linear, then (per micro-batch, per step) per engine
    models = {engine: cost_model for engine in engines}
    step_costs = {engine: 0.0 for engine in engines}
    assignment = None
    for _ in range(max_rounds):
        rows, targets, features = [], [], []
        for engine, plan, seconds in steps:
            squares, linear, micro_batches = _features(plan, engine, models[engine])
            features.append((squares, linear, micro_batches))
            row = [squares, linear] + [0.0] * (columns - 2)
            slot = 2 + 2 * engines.index(engine)
            row[slot], row[slot + 1] = micro_batches, 1.0
            rows.append([value / seconds for value in row])  # relative error: every step counts alike
            targets.append(1.0)
        if features == assignment:
            break
        assignment = features
        solution = nonnegative_least_squares(rows, targets)
        if solution[0] == 0 and solution[1] == 0:
            raise ODCError("calibrate: measured steps do not grow with sequence length; cannot fit compute")
        for number, engine in enumerate(engines):
            per_micro_batch, per_step = solution[2 + 2 * number], solution[3 + 2 * number]
            models[engine] = CostModel(quadratic=solution[0], linear=solution[1], per_micro_batch=per_micro_batch)
            step_costs[engine] = per_step
    hardware = {engine: Hardware(layers=1, prefetch_depth=0, optimizer_seconds=step_costs[engine],
                                 description=f"calibrated to measured {engine} steps") for engine in engines}
    return Calibration(models, hardware)


def held_out_errors(runs: Sequence[dict], cost_model: CostModel, group: Callable[[dict], object]) -> list[dict]:
    """For every group of runs (e.g. one benchmark cell): calibrate on the *other* groups, predict
    this group's steps, and return ``{"run", "predicted", "relative_errors", "median_error"}`` per
    run. A run whose engine has no runs outside its group is not predicted (empty lists)."""
    results = []
    for key in sorted({group(r) for r in runs}, key=str):
        outside = [r for r in runs if group(r) != key]
        fitted = calibrate(outside, cost_model) if outside else Calibration({}, {})
        for run in (r for r in runs if group(r) == key):
            predicted, errors = [], []
            if run["engine"] in fitted.hardware:
                for engine, plan, seconds in _steps([run], cost_model):
                    value = fitted.predict(plan, engine)
                    predicted.append(value)
                    errors.append(abs(value - seconds) / seconds)
            results.append({"run": run, "predicted": predicted, "relative_errors": errors,
                            "median_error": statistics.median(errors) if errors else float("nan")})
    return results
