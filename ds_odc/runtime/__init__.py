"""The ODC runtime: layout, micro-batch ledger, pull/push and the step protocol. DeepSpeed-agnostic."""
from ds_odc.runtime.core import ODCRuntime
from ds_odc.runtime.layout import ShardSlot, WindowLayout, owner_slices
from ds_odc.runtime.ledger import MicroBatchLedger, Normalisation, StepTotals
from ds_odc.runtime.step import GlobalNorms, Phase, StepProtocol, StepUpdate

__all__ = ["ODCRuntime", "Phase", "ShardSlot", "WindowLayout", "owner_slices",
           "MicroBatchLedger", "Normalisation", "StepTotals", "GlobalNorms", "StepProtocol", "StepUpdate"]
