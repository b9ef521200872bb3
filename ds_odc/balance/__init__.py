"""Minibatch planning for uneven sequence lengths: LB-Mini, LB-Micro and LocalSort; and the long samples
split over aligned Ulysses groups (``plan_split``; ``split_batch`` cuts a rank's slice of a split micro-batch).

>>> plan = plan_minibatch([900, 100, 100, 100, 500, 300], world_size=2, token_cap=1000)
>>> plan.rank_costs()
[1000.0, 1000.0]
"""
from ds_odc.balance.cost import CostModel, fit_cost_model, forward_backward_timer
from ds_odc.balance.packing import PADDINGS
from ds_odc.balance.partition import karmarkar_karp, refine
from ds_odc.balance.planner import POLICIES, Plan, plan_minibatch
from ds_odc.balance.sampler import BalancedBatchSampler
from ds_odc.balance.slices import split_batch
from ds_odc.balance.split import plan_split
from ds_odc.balance.split_cost import AllToAllCost, SplitCostModel, fit_all_to_all
from ds_odc.balance.split_plan import SPLIT_POLICY, MicroBatch, SplitMicroBatch, SplitPlan, max_group_for_heads

__all__ = ["AllToAllCost", "BalancedBatchSampler", "CostModel", "MicroBatch", "PADDINGS", "POLICIES", "Plan",
           "SPLIT_POLICY", "SplitCostModel", "SplitMicroBatch", "SplitPlan", "fit_all_to_all", "fit_cost_model",
           "forward_backward_timer", "karmarkar_karp", "max_group_for_heads", "plan_minibatch", "plan_split",
           "refine", "split_batch"]
