"""The figures a monitor shows: every rank's step reports reduced to a few named numbers (``ODC/...``).

Two halves, so that ranks exchange as little as possible:

* :func:`rank_row`: what one rank contributes, over the steps since the last write (its *window*): one number
  per :data:`FIELDS` entry the job uses (:func:`fields_for`), each per step;
* :func:`figures`: every rank's rows (one column per field) and rank 0's own window (the step's wall time,
  every rank's micro-batch count as ODC's fence learned it, the planner's prediction) -> ``{name: value}``.

Every figure is per optimizer step, averaged over the window (a window of one step is that step). The names
are the same on ZeRO-3 and ODC where they mean the same (docs/metrics.md lists them), so one dashboard
compares the two.

>>> from ds_odc.metrics.step_report import PlannedStep, StepReport
>>> def report(rank, compute, fence):
...     return StepReport(rank=rank, step=0, start=0.0, wall_s=4.0, compute_s=compute, gather_s=0.1, reduce_s=0.1,
...                       step_wait_s=fence, optimizer_s=0.2, counters=(("tokens", 10.0 * len(compute)),),
...                       all_micro_batches=(1, 3), plan=PlannedStep((1.0, 3.0), 3.0))
>>> mine, theirs = [report(0, (1.0,), 2.5)], [report(1, (1.0, 1.0, 1.0), 0.1)]
>>> names = fields_for(fenced=True)
>>> columns = {name: [a, b] for name, a, b in zip(names, rank_row(mine, names), rank_row(theirs, names))}
>>> shown = figures(columns, mine)
>>> shown["ODC/micro_batches/min"], shown["ODC/micro_batches/max"], shown["ODC/tokens/max"]
(1.0, 3.0, 30.0)
>>> round(shown["ODC/utilisation/min"], 3), round(shown["ODC/balance"], 3), round(shown["ODC/plan/balance"], 3)
(0.3, 0.667, 0.667)
"""
from __future__ import annotations

from typing import Callable, Mapping, NamedTuple, Optional, Sequence

from ds_odc.metrics.step_report import StepReport, balance, utilisation

PREFIX = "ODC/"
#: A field a rank cannot measure (no tokens seen): sent as this, and its figures are left out.
UNKNOWN = -1.0


class Field(NamedTuple):
    name: str
    of: Callable[[Sequence[StepReport]], float]
    """the rank's value over its window (per step)"""


def _per_step(value: Callable[[StepReport], float]) -> Callable[[Sequence[StepReport]], float]:
    return lambda reports: sum(value(r) for r in reports) / len(reports)


def _counted(name: str) -> Callable[[Sequence[StepReport]], float]:
    """A counter per step; ``UNKNOWN`` when no step of the window counted it."""
    def of(reports):
        if not any(r.has_counter(name) for r in reports):
            return UNKNOWN
        return sum(r.counter(name) for r in reports) / len(reports)
    return of


#: Every field a rank can contribute, in the order rows carry them.
FIELDS = {field.name: field for field in (
    Field("utilisation", utilisation),
    Field("compute_s", _per_step(lambda r: sum(r.compute_s))),
    Field("pull_s", _per_step(lambda r: r.gather_s)),
    Field("push_s", _per_step(lambda r: r.reduce_s)),
    Field("fence_s", _per_step(lambda r: r.step_wait_s)),
    Field("tokens", _counted("tokens")),
    Field("micro_batches", _per_step(lambda r: r.micro_batches)),
    Field("pull_bytes", _counted("pull_bytes")),
    Field("push_bytes", _counted("push_bytes")),
    Field("cross_node_s", _counted("cross_node_s")),
    Field("split_micro_batches", _counted("split_micro_batches")),
    Field("split_s", _counted("split_s")),
    Field("offload_bytes", _counted("offload_bytes")),
)}


def fields_for(*, fenced: bool, bytes_counted: bool = True, cross_node: bool = False, split: bool = False,
               offload: bool = False) -> list[str]:
    """The fields a job's rows carry, the same on every rank (decided from its config when the recorder is
    attached). ``fenced``: the step learns every rank's micro-batch count itself (ODC's fence), so rows leave it
    out; ``bytes_counted``: pulls and pushes are counted (ODC); the rest: the job uses several nodes, the split
    policy, activation offload. The common set comes first, so an ODC job without those options fits one round
    of :data:`ds_odc.runtime.core.VALUES_WIDTH` (8) values."""
    names = ["utilisation", "compute_s", "pull_s", "push_s", "fence_s", "tokens"]
    names += [] if fenced else ["micro_batches"]
    names += ["pull_bytes", "push_bytes"] if bytes_counted else []
    names += ["cross_node_s"] if cross_node else []
    names += ["split_micro_batches", "split_s"] if split else []
    names += ["offload_bytes"] if offload else []
    return names


def rank_row(reports: Sequence[StepReport], names: Sequence[str]) -> list[float]:
    """This rank's values of ``names`` over ``reports`` (its window; at least one)."""
    if not reports:
        raise ValueError("rank_row needs at least one step report")
    return [float(FIELDS[name].of(reports)) for name in names]


def _spread(out: dict, name: str, values: Sequence[float], stats=("mean", "max"), unit: str = "s") -> None:
    suffix = f"_{unit}" if unit else ""
    if any(v == UNKNOWN for v in values):
        return
    if "mean" in stats:
        out[f"{PREFIX}{name}/mean{suffix}"] = sum(values) / len(values)
    if "min" in stats:
        out[f"{PREFIX}{name}/min{suffix}"] = min(values)
    if "max" in stats:
        out[f"{PREFIX}{name}/max{suffix}"] = max(values)


def figures(columns: Mapping[str, Sequence[float]], own: Sequence[StepReport]) -> dict[str, float]:
    """The named figures of one write: ``columns`` holds every rank's value of each field (rank order), ``own``
    is this rank's window (for the step's wall time, the fence's counts and the plan: the same on every rank)."""
    out: dict[str, float] = {}
    util = columns["utilisation"]
    out[f"{PREFIX}utilisation/mean"] = sum(util) / len(util)
    out[f"{PREFIX}utilisation/min"] = min(util)
    out[f"{PREFIX}idle_fraction"] = 1.0 - out[f"{PREFIX}utilisation/mean"]
    out[f"{PREFIX}step_s"] = sum(r.wall_s for r in own) / len(own)
    counts = columns.get("micro_batches") or fenced_counts(own)
    if counts:
        _spread(out, "micro_batches", counts, ("min", "max"), unit="")
    _spread(out, "tokens", columns["tokens"], ("min", "max"), unit="")
    compute = columns["compute_s"]
    _spread(out, "compute", compute)
    out[f"{PREFIX}balance"] = balance(compute)
    plan = planned(own)
    if plan is not None:
        out[f"{PREFIX}plan/balance"], out[f"{PREFIX}plan/step_cost"] = plan
    for field, name in (("pull_s", "pull"), ("push_s", "push"), ("fence_s", "fence_wait"),
                        ("cross_node_s", "cross_node"), ("split_s", "split")):
        if field in columns:
            _spread(out, name, columns[field])
    for field, name in (("pull_bytes", "pull"), ("push_bytes", "push"), ("offload_bytes", "activation_offload")):
        if field in columns:
            _spread(out, name, columns[field], unit="bytes")
    if "split_micro_batches" in columns:
        _spread(out, "split/micro_batches", columns["split_micro_batches"], ("min", "max"), unit="")
    return out


def fenced_counts(reports: Sequence[StepReport]) -> Optional[list[float]]:
    """Each rank's micro-batches per step over ``reports``, from ODC's fence; None where a step lacks them."""
    if not reports or any(not r.all_micro_batches for r in reports):
        return None
    ranks = len(reports[0].all_micro_batches)
    if any(len(r.all_micro_batches) != ranks for r in reports):
        return None
    return [sum(r.all_micro_batches[k] for r in reports) / len(reports) for k in range(ranks)]


def planned(reports: Sequence[StepReport]) -> Optional[tuple[float, float]]:
    """(balance, step cost per step) the planner predicted over ``reports``, if every one of them has a plan: the
    balance of the summed rank costs, as :func:`figures` measures the balance of the summed compute."""
    plans = [r.plan for r in reports if r.plan is not None]
    if not plans or len(plans) != len(reports) or any(len(p.rank_costs) != len(plans[0].rank_costs) for p in plans):
        return None
    summed = [sum(costs) for costs in zip(*(p.rank_costs for p in plans))]
    return balance(summed), sum(p.step_cost for p in plans) / len(plans)


#: What each figure means (docs/metrics.md renders the same table by hand; a test keeps them in step).
MEANINGS = {
    "utilisation/mean": "busy (compute + optimizer) over wall time, mean over ranks",
    "utilisation/min": "the same, of the least busy rank",
    "idle_fraction": "1 - utilisation/mean: the share of rank-time spent waiting",
    "step_s": "wall time of the step (rank 0's; ranks end a step together)",
    "micro_batches/min": "micro-batches of the rank that ran fewest",
    "micro_batches/max": "... that ran most",
    "tokens/min": "tokens the forwards received, of the rank that received fewest",
    "tokens/max": "... most",
    "compute/mean_s": "compute time (forward + backward less pulls/pushes inside), mean over ranks",
    "compute/max_s": "... of the slowest rank: what the planner's step cost predicts",
    "balance": "compute/mean_s over compute/max_s (1 = every rank computed as long)",
    "plan/balance": "the balance the planner predicted (mean over max of its rank costs)",
    "plan/step_cost": "the planner's step cost (busiest rank), in its cost model's unit",
    "pull/mean_s": "ODC: time in pulls (ZeRO-3: all-gathers), mean over ranks",
    "pull/max_s": "... of the rank that spent most",
    "pull/mean_bytes": "ODC: bytes pulled per rank (parameters read, the rank's own shards included)",
    "pull/max_bytes": "... of the rank that pulled most",
    "push/mean_s": "ODC: time in pushes (ZeRO-3: reduce-scatters), mean over ranks",
    "push/max_s": "... of the rank that spent most",
    "push/mean_bytes": "ODC: gradient bytes pushed per rank",
    "push/max_bytes": "... of the rank that pushed most",
    "fence_wait/mean_s": "ODC: the step's rounds (fence, norm, publish; ZeRO-3: overflow check and norm "
                         "all-reduces), mean over ranks: where a fast rank waits for the slowest",
    "fence_wait/max_s": "... of the rank that waited longest",
    "cross_node/mean_s": "ODC on several nodes: the step's exchange between nodes, mean over ranks",
    "cross_node/max_s": "... of the slowest rank",
    "split/micro_batches/min": "ODC, split policy: split micro-batches a rank took part in, fewest",
    "split/micro_batches/max": "... most",
    "split/mean_s": "ODC, split policy: time inside split micro-batches (their lockstep, forward, backward and "
                    "Ulysses all-to-alls), mean over ranks",
    "split/max_s": "... of the rank that spent most",
    "activation_offload/mean_bytes": "ODC, activation offload: bytes of saved activations copied to the host, "
                                     "mean over ranks",
    "activation_offload/max_bytes": "... of the rank that offloaded most",
}


class Window:
    """The steps a writer has not shown yet: each :meth:`take` returns the recorder's reports since the last one
    (at most the recorder's ``history``). A new recorder (the engine was rebuilt) starts a new window."""

    def __init__(self) -> None:
        self._recorder: object = None
        self._last = -1

    def take(self, recorder) -> list[StepReport]:
        if recorder is not self._recorder:
            self._recorder, self._last = recorder, -1
        new: list[StepReport] = []
        for report in reversed(recorder.reports):
            if report.step <= self._last:
                break
            new.append(report)
        new.reverse()
        if new:
            self._last = new[-1].step
        return new
