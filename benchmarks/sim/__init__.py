"""Project step time beyond this machine: a discrete-event replay of a minibatch plan, layer by
layer, under a collective engine (ZeRO-3 / FSDP: every layer's gather and reduce is a sync point
across all ranks) and under ODC (point-to-point pulls and pushes, one meeting per step).

Why a simulator: this machine has 2 CPU ranks, and what ODC buys grows with the number of ranks
and with how well communication hides behind compute. The simulator takes the same plans the
balancers produce and a small description of the hardware, and answers "how long would this step
take on 8-64 ranks?", with every assumption in :mod:`benchmarks.sim.presets`. It is validated against
the measured 2-rank runs by ``benchmarks/sim_projection.py``.

Modules: ``hardware`` (what a machine costs per layer and per step), ``timeline`` (the replay),
``presets`` (the paper's golden setting; a machine measured here), ``projection`` (replaying
recorded steps; projecting sampled minibatches), ``calibrate`` (fitting compute and each engine's fixed
costs to measured steps).

>>> from ds_odc.balance import plan_minibatch
>>> lengths = longalign_like_lengths(32, seed=0)
>>> plan = plan_minibatch(lengths, 8, GOLDEN_TOKEN_CAP, "lb-mini", GOLDEN_COST_MODEL)
>>> odc = simulate_step(plan, golden_preset(8), "odc")
>>> odc.step_seconds >= plan.odc_step_cost()
True
"""
from benchmarks.sim.calibrate import Calibration, calibrate, held_out_errors
from benchmarks.sim.hardware import Hardware, Link, spread_over_peers
from benchmarks.sim.presets import (
    GOLDEN_COST_MODEL,
    GOLDEN_SAMPLES_PER_RANK,
    GOLDEN_TOKEN_CAP,
    GOLDEN_WORLD_SIZE,
    MEASURED_COMM_KEYS,
    golden_preset,
    longalign_like_lengths,
    measured_preset,
)
from benchmarks.sim.projection import ENGINE_SCHEMES, PROJECTED, Projection, plan_from_record, project, replay_run
from benchmarks.sim.timeline import SCHEMES, StepResult, simulate_step

__all__ = ["Calibration", "ENGINE_SCHEMES", "GOLDEN_COST_MODEL", "GOLDEN_SAMPLES_PER_RANK", "GOLDEN_TOKEN_CAP",
           "GOLDEN_WORLD_SIZE", "Hardware", "Link", "MEASURED_COMM_KEYS", "PROJECTED", "Projection", "SCHEMES",
           "StepResult", "calibrate", "golden_preset", "held_out_errors", "longalign_like_lengths",
           "measured_preset", "plan_from_record", "project", "replay_run", "simulate_step", "spread_over_peers"]
