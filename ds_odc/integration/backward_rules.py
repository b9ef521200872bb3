"""Which normalisation rule a backward asks for (:mod:`ds_odc.runtime.ledger`), decided from how it was called.

* a token count declared for it (``engine.backward(loss, loss_tokens=n)``, ``engine.set_loss_tokens(n)``): the
  per-token rule (TOKEN), whose loss is a sum and whose micro-batch DeepSpeed must not divide by
  ``gradient_accumulation_steps``;
* else, under ``loss_normalization: "token"``: refused by name (every backward must report its tokens);
* else managed accumulation with ``scale_wrt_gas`` and ``gradient_accumulation_steps`` > 1: the mean over the
  global micro-batches (MEAN; DeepSpeed's per-micro-batch division is kept and corrected at the step);
* else the caller's own scaling (CALLER). With ``gradient_accumulation_steps`` 1 every backward is its own
  boundary: several before one step are the caller accumulating (OpenRLHF's actor update), which ZeRO-3 sums,
  where the mean would divide by the count (docs/normalisation.md). The two rules agree for one backward per rank.

>>> decide(None, "auto", managed=True, scale_wrt_gas=True, gradient_accumulation_steps=4).rule.name
'MEAN'
>>> decide(12, "auto", managed=True, scale_wrt_gas=True, gradient_accumulation_steps=4)
BackwardRule(rule=<LossNormalization.TOKEN: 2>, tokens=12)
>>> decide(None, "auto", managed=True, scale_wrt_gas=True, gradient_accumulation_steps=1).rule.name
'CALLER'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ds_odc.errors import ODCConfigError
from ds_odc.runtime import LossNormalization


@dataclass(frozen=True)
class BackwardRule:
    rule: LossNormalization
    tokens: int = 0

    @property
    def skips_gas_division(self) -> bool:
        """Per-token micro-batches are not divided by ``gradient_accumulation_steps``; the others keep
        DeepSpeed's division (MEAN corrects it at the step, CALLER is the caller's choice)."""
        return self.rule is LossNormalization.TOKEN


def decide(tokens: Optional[int], loss_normalization: str, managed: bool, scale_wrt_gas: bool,
           gradient_accumulation_steps: int) -> BackwardRule:
    """The rule of one backward (see the module docstring)."""
    if tokens is not None:
        return BackwardRule(LossNormalization.TOKEN, tokens)
    if loss_normalization == "token":
        raise ODCConfigError("zero_optimization.odc.loss_normalization='token': this backward has no token "
                             "count; call engine.backward(loss, loss_tokens=n) or engine.set_loss_tokens(n)")
    if managed and scale_wrt_gas and gradient_accumulation_steps > 1:
        return BackwardRule(LossNormalization.MEAN)
    return BackwardRule(LossNormalization.CALLER)
