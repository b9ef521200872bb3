"""Minibatch planning for uneven sequence lengths: LB-Mini, LB-Micro and LocalSort.

>>> plan = plan_minibatch([900, 100, 100, 100, 500, 300], world_size=2, token_cap=1000)
>>> plan.rank_costs()
[1000.0, 1000.0]
"""
from ds_odc.balance.cost import CostModel, fit_cost_model, forward_backward_timer
from ds_odc.balance.packing import PADDINGS
from ds_odc.balance.partition import karmarkar_karp, refine
from ds_odc.balance.planner import POLICIES, Plan, plan_minibatch
from ds_odc.balance.sampler import BalancedBatchSampler

__all__ = ["BalancedBatchSampler", "CostModel", "PADDINGS", "POLICIES", "Plan", "fit_cost_model",
           "forward_backward_timer", "karmarkar_karp", "plan_minibatch", "refine"]
