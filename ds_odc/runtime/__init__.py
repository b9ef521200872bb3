"""The ODC runtime: layout, micro-batch ledger, pull/push and the step protocol, and the one place a
session is opened. DeepSpeed-agnostic; transports and links come from ``ds_odc.comm``."""
from ds_odc.runtime.core import ODCRuntime
from ds_odc.runtime.layout import ShardSlot, WindowLayout, owner_slices
from ds_odc.runtime.ledger import LossNormalization, MicroBatchLedger, StepTotals
from ds_odc.runtime.round_kinds import Activity, RoundKind
from ds_odc.runtime.session import SessionPlan, Shard, open_session
from ds_odc.runtime.step import Phase, StepProtocol
from ds_odc.runtime.step_update import GlobalNorms, StepUpdate

__all__ = ["ODCRuntime", "Phase", "ShardSlot", "WindowLayout", "owner_slices", "MicroBatchLedger", "LossNormalization",
           "StepTotals", "GlobalNorms", "StepProtocol", "StepUpdate", "SessionPlan", "Shard", "open_session",
           "Activity", "RoundKind"]
