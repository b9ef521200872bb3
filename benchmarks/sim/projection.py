"""Two uses of the simulator: replay measured steps (to state its error) and project to many ranks.

``replay_run`` rebuilds each measured step's plan from the recorded lengths and micro-batches and
simulates it, so its prediction can be set beside the measured step time. ``project`` samples
LongAlign-like minibatches, plans them with each policy, and simulates every (scheme, policy) pair
on the same minibatches, so the speedups it reports compare like with like.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

from benchmarks.sim.hardware import Hardware
from benchmarks.sim.presets import GOLDEN_COST_MODEL, GOLDEN_TOKEN_CAP, golden_preset, longalign_like_lengths
from benchmarks.sim.timeline import simulate_step
from ds_odc.balance import CostModel, Plan, plan_minibatch
from ds_odc.errors import ODCError

ENGINE_SCHEMES = {"zero3": "collective", "odc": "odc"}
"""The benchmark's engine names and the scheme that models each."""

PROJECTED = (("collective", "lb-micro"), ("odc", "lb-micro"), ("odc", "lb-mini"))
"""Baseline first: every speedup is over collective + LB-Micro, as in the paper."""


def plan_from_record(lengths: Sequence[int], micro_batches: Sequence, cost_model: CostModel,
                     policy: str = "recorded") -> Plan:
    """A :class:`Plan` for a step a benchmark ran: ``micro_batches[rank][m]`` lists sample indices."""
    try:
        batches = tuple(tuple(tuple(int(i) for i in batch) for batch in rank) for rank in micro_batches)
    except TypeError as error:
        raise ODCError(f"recorded micro_batches must be [rank][micro-batch][sample index]: {error}") from None
    lengths = tuple(int(s) for s in lengths)
    for rank, rank_batches in enumerate(batches):
        for batch in rank_batches:
            for index in batch:
                if not 0 <= index < len(lengths):
                    raise ODCError(f"recorded micro-batch of rank {rank} names sample {index}, "
                                   f"but the step has {len(lengths)} lengths")
    cap = max((sum(lengths[i] for i in b) for r in batches for b in r), default=1)
    return Plan(policy, lengths, max(cap, 1), cost_model, batches)


def replay_run(run: dict, cost_model: CostModel, hardware: Hardware) -> dict:
    """Predicted vs measured step seconds for one recorded run of the benchmark.

    Returns ``{"predicted": [...], "measured": [...], "relative_errors": [...], "median_error": x}``
    over the steps that have both a record and a measured time."""
    for key in ("engine", "steps", "step_seconds"):
        if key not in run:
            raise ODCError(f"benchmark run is missing {key!r} (has {sorted(run)})")
    if run["engine"] not in ENGINE_SCHEMES:
        raise ODCError(f"benchmark run engine {run['engine']!r} unknown; expected one of {sorted(ENGINE_SCHEMES)}")
    scheme = ENGINE_SCHEMES[run["engine"]]
    predicted, measured = [], []
    for step, seconds in zip(run["steps"], run["step_seconds"]):
        plan = plan_from_record(step["lengths"], step["micro_batches"], cost_model, run.get("policy", "recorded"))
        predicted.append(simulate_step(plan, hardware, scheme).step_seconds)
        measured.append(float(seconds))
    errors = [abs(p - m) / m for p, m in zip(predicted, measured) if m > 0]
    return {"predicted": predicted, "measured": measured, "relative_errors": errors,
            "median_error": statistics.median(errors) if errors else float("nan")}


@dataclasses.dataclass(frozen=True)
class Projection:
    """Mean simulated step seconds of each (scheme, policy) on the same minibatches, and of the
    balance bound (free communication) for the same pairs."""

    world_size: int
    samples_per_rank: int
    steps: int
    step_seconds: dict
    bound_seconds: dict
    mean_micro_batches: dict

    def speedup(self, scheme: str, policy: str, bound: bool = False) -> float:
        """Throughput over collective + LB-Micro's, minus 1 (the paper's definition)."""
        table = self.bound_seconds if bound else self.step_seconds
        return table[PROJECTED[0]] / table[(scheme, policy)] - 1.0


def project(world_size: int, samples_per_rank: int, steps: int = 10, seed: int = 0,
            hardware: Hardware | None = None, cost_model: CostModel = GOLDEN_COST_MODEL,
            token_cap: int = GOLDEN_TOKEN_CAP, plan_cost_model: CostModel | None = None,
            length_sigma: float = 0.7) -> Projection:
    """Simulate ``steps`` LongAlign-like minibatches of ``samples_per_rank × world_size`` samples.

    ``cost_model`` is the true compute cost; ``plan_cost_model`` (default the same) is what the
    balancers plan with. ``hardware`` defaults to :func:`golden_preset` for ``world_size``.
    ``length_sigma`` is the lognormal's σ of :func:`longalign_like_lengths` (the tail's weight)."""
    if steps < 1:
        raise ODCError(f"project: steps must be >= 1, got {steps}")
    if samples_per_rank < 1:
        raise ODCError(f"project: samples_per_rank must be >= 1, got {samples_per_rank}")
    hardware = hardware or golden_preset(world_size)
    free = hardware.without_communication()
    planner = plan_cost_model or cost_model
    totals = {pair: 0.0 for pair in PROJECTED}
    bounds = {pair: 0.0 for pair in PROJECTED}
    micro_batches = {pair: 0 for pair in PROJECTED}
    for step in range(steps):
        lengths = longalign_like_lengths(world_size * samples_per_rank, seed=seed * 100003 + step, cap=token_cap,
                                         sigma=length_sigma)
        plans = {policy: plan_minibatch(lengths, world_size, token_cap, policy, planner, seed=step)
                 for policy in {policy for _, policy in PROJECTED}}
        for scheme, policy in PROJECTED:
            result = simulate_step(plans[policy], hardware, scheme, cost_model)
            totals[(scheme, policy)] += result.step_seconds
            bounds[(scheme, policy)] += simulate_step(plans[policy], free, scheme, cost_model).step_seconds
            micro_batches[(scheme, policy)] += max(result.micro_batches_run, default=0)
    return Projection(world_size, samples_per_rank, steps,
                      {pair: total / steps for pair, total in totals.items()},
                      {pair: total / steps for pair, total in bounds.items()},
                      {pair: count / steps for pair, count in micro_batches.items()})
