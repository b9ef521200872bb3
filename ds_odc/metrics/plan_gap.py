"""A warning when the balance the planner predicts and the one measured part ways for several writes in a row.

The planner spreads each step's samples so that every rank's predicted compute is about equal (its cost model
prices a sample); the recorder measures each rank's compute. When the measured balance (mean over the slowest
rank's compute) stays well below the predicted one, the cost model no longer describes this model on this
machine, and ranks wait for the slowest at every step. One noisy step is not that: the gap must persist.

>>> gap = PlanGap(persist=3)
>>> [gap.observe(0.95, 0.60) is not None for _ in range(5)]
[False, False, True, False, False]
>>> gap.observe(0.95, 0.94), gap.streak
(None, 0)
"""
from __future__ import annotations

from typing import Optional

#: How far below the prediction the measured balance must be (absolute) to count.
GAP = 0.15
#: In how many consecutive writes.
PERSIST = 3
#: While the gap lasts, the warning comes back at most once per this many writes.
REPEAT_AFTER = 100


class PlanGap:
    """Feeds on (predicted, measured) balance pairs, one per write of the figures; says when to warn."""

    def __init__(self, gap: float = GAP, persist: int = PERSIST, repeat_after: int = REPEAT_AFTER):
        self.gap, self.persist, self.repeat_after = gap, persist, repeat_after
        self.streak = 0  # consecutive writes with the gap
        self.warnings = 0

    def observe(self, predicted: float, measured: float) -> Optional[str]:
        """The warning's text when it is due, else None."""
        if predicted - measured <= self.gap:
            self.streak = 0
            return None
        self.streak += 1
        due = self.streak == self.persist or (
            self.streak > self.persist and (self.streak - self.persist) % self.repeat_after == 0)
        if not due:
            return None
        self.warnings += 1
        return (f"ds_odc: the measured compute balance ({measured:.2f}: mean over the slowest rank's compute) has "
                f"stayed below the balance the planner predicts ({predicted:.2f}) for {self.streak} writes of the "
                "figures: its cost model no longer prices this model's micro-batches on this machine, and ranks wait "
                "for the slowest at every step. Fit it here: set zero_optimization.odc.balance.cost_model to "
                "\"measure\" (or pass a CostModel fitted with ds_odc.balance.fit_cost_model to the sampler); "
                "docs/balancing.md says how. (Repeated at most once per "
                f"{self.repeat_after} writes while the gap lasts.)")
