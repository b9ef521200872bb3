"""Projection of Ulysses sequence parallelism: SP groups as the balancers' replicas.

Under SP of size ``p`` the ``p`` ranks of a group run the same micro-batches, each on ``1/p`` of every
sequence: the plan is made over ``world / p`` groups, and a group's ranks are identical, so a group is
simulated as one rank whose micro-batch costs (assumptions, named):

- compute ``(a·x² + b·x) / p``: Ulysses splits attention by heads (``a·x²/p``) and everything else by tokens
  (``b·x/p``);
- plus the all-to-alls, not overlapped with compute (conservative): 4 per layer forward (q, k, v, output)
  and 4 backward, each moving ``(s/p)·h·2`` bytes (bf16) of which ``(p-1)/p`` leaves the rank, over the
  node's link (every SP group inside a node, as the odc stage requires);
- parameter gathers and gradient reduces (ZeRO-3: collectives over the world; ODC: one rank's pulls and
  pushes) per layer per micro-batch, as without SP (:func:`~benchmarks.sim.presets.golden_preset` of the
  world): every rank still holds full layers while it computes.

Memory is not modelled: whether a sequence fits a group is ALST's question (it reports 500K tokens of
Llama-8B on one H100 and 3.7M on 8 with its offloads and tiling); this projects step time at lengths that do.
"""
from __future__ import annotations

import dataclasses

from benchmarks.sim.presets import GOLDEN_COST_MODEL, golden_preset, longalign_like_lengths
from benchmarks.sim.projection import PROJECTED
from benchmarks.sim.timeline import simulate_step
from ds_odc.balance import CostModel, plan_minibatch
from ds_odc.errors import ODCError

HIDDEN = 1536  # the golden 1.5B model's hidden size
LAYERS = 28
ALL_TO_ALLS_PER_LAYER = 8  # 4 forward, 4 backward
NODE_LINK_BYTES_PER_S = 130e9


def all_to_all_seconds_per_token(sp: int, hidden: int = HIDDEN, layers: int = LAYERS,
                                 bandwidth: float = NODE_LINK_BYTES_PER_S) -> float:
    """Seconds of all-to-all per token of the whole sequence, on each rank of an SP group of ``sp``."""
    if sp < 1:
        raise ODCError(f"sequence parallel size must be >= 1, got {sp}")
    return ALL_TO_ALLS_PER_LAYER * layers * hidden * 2 * (sp - 1) / (sp * sp) / bandwidth


def sp_cost_model(base: CostModel, sp: int) -> CostModel:
    """What one micro-batch costs each rank of an SP group of ``sp`` (see the module docstring)."""
    return CostModel(quadratic=base.quadratic / sp, linear=base.linear / sp + all_to_all_seconds_per_token(sp),
                     per_micro_batch=base.per_micro_batch)


@dataclasses.dataclass(frozen=True)
class SPProjection:
    world_size: int
    sp: int
    samples_per_group: int
    token_cap: int
    step_seconds: dict  # (scheme, policy) -> mean simulated seconds
    utilisation: dict

    def speedup(self, scheme: str, policy: str) -> float:
        return self.step_seconds[PROJECTED[0]] / self.step_seconds[(scheme, policy)] - 1.0


def project_sp(world_size: int, sp: int, samples_per_group: int = 4, token_cap: int = 131072, steps: int = 10,
               seed: int = 0, mean_tokens: float = 33080, sigma: float = 0.7) -> SPProjection:
    """Mean step seconds of collective + LB-Micro, ODC + LB-Micro and ODC + LB-Mini over ``steps``
    LongAlign-like minibatches (lengths of mean ``mean_tokens``, clipped to ``token_cap``) of
    ``samples_per_group × world_size / sp`` samples, planned over the SP groups."""
    if world_size % sp:
        raise ODCError(f"world_size {world_size} is not a multiple of the SP size {sp}")
    groups = world_size // sp
    model = sp_cost_model(GOLDEN_COST_MODEL, sp)
    hardware = golden_preset(world_size)
    totals = {pair: 0.0 for pair in PROJECTED}
    busy = {pair: 0.0 for pair in PROJECTED}
    for step in range(steps):
        lengths = longalign_like_lengths(groups * samples_per_group, seed=seed * 100003 + step, mean=mean_tokens,
                                         cap=token_cap, sigma=sigma)
        plans = {policy: plan_minibatch(lengths, groups, token_cap, policy, model, seed=step)
                 for policy in {policy for _, policy in PROJECTED}}
        for scheme, policy in PROJECTED:
            result = simulate_step(plans[policy], hardware, scheme)
            totals[(scheme, policy)] += result.step_seconds
            busy[(scheme, policy)] += result.utilisation
    return SPProjection(world_size, sp, samples_per_group, token_cap,
                        {pair: total / steps for pair, total in totals.items()},
                        {pair: total / steps for pair, total in busy.items()})
