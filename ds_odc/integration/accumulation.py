"""Unmanaged gradient accumulation on DeepSpeed releases without it (``surface_table.MANAGED_ACCUMULATION``).

From DeepSpeed 0.19.4 a ds_config may say ``"managed_gradient_accumulation": false``: the caller owns the
boundary (``set_gradient_accumulation_boundary``), and every ``step()`` is one. Earlier releases ignore the key and
count micro-steps. ODC ranks run different numbers of micro-batches per step, so a micro-step count cannot be the
boundary there: :class:`UnmanagedAccumulation` (a base of ``ODCEngine``) reads the key itself on those releases and
makes every ``step()`` the boundary, unless the caller set one. On newer releases it is DeepSpeed's own.
"""
from __future__ import annotations

from ds_odc.integration.surface import has
from ds_odc.integration.surface_table import MANAGED_ACCUMULATION


class UnmanagedAccumulation:
    """The two methods of ``DeepSpeedEngine`` that decide the boundary, as the module docstring says."""

    def managed_gradient_accumulation(self):
        """DeepSpeed's ``managed_gradient_accumulation()``; on releases without it, the ds_config's key
        (DeepSpeed ignores it there, and this engine provides the behaviour: every ``step()`` is the boundary)."""
        if has(MANAGED_ACCUMULATION):
            return super().managed_gradient_accumulation()  # type: ignore[misc]
        return bool(self._config._param_dict.get("managed_gradient_accumulation", True))  # type: ignore[attr-defined]

    def is_gradient_accumulation_boundary(self):
        if has(MANAGED_ACCUMULATION) or self._is_gradient_accumulation_boundary is not None or \
                self.managed_gradient_accumulation():  # type: ignore[attr-defined]
            return super().is_gradient_accumulation_boundary()  # type: ignore[misc]
        # the micro-step count of "(self.micro_steps + 1) % self.gradient_accumulation_steps() == 0" replaced:
        # the caller owns the boundary, and ODC pushes every backward's gradients whatever the boundary says
        return True
