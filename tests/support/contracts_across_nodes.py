"""ZeRO-3's job-wide calls on several nodes (docs/multinode.md): gradient reads between backward and step, a
``zero_grad`` between micro-batches, and writes through ZeRO-3's collective APIs (``safe_set_full_grad``,
``safe_set_full_fp32_param``, ``GatheredParameters`` with a modifier rank). The workloads of
test_zero3_contracts.py (one node), run on 2 nodes x 2 ranks on ZeRO-3 and on the odc stage under each
cross_node mode, in turn in one job: the two-host cases job (test_two_hosts_global.py), which compares each mode
with ZeRO-3 on the same 4 ranks. Under global and budget these are the rounds whose cross-node settling
(``StepProtocol``'s gradient fence and discard across nodes) no one-node test reaches."""
from __future__ import annotations

from tests.support import contract_workloads
from tests.support.budget_workloads import BUDGET

#: the odc stage's options per cross_node mode (ZeRO-3 first, with none)
MODES = {"zero3": None, "replicate": {"cross_node": "replicate"}, "global": {"cross_node": "global"},
         "budget": BUDGET}
COUNTS = (2, 2, 2, 2)  # ZeRO-3 needs equal counts for its reads; the one-node tests cover uneven ones


def job_wide_calls() -> dict:
    """{mode: {"reads", "zero_grad", "writes"}} as this rank observed them."""
    result = {}
    for mode, odc in MODES.items():
        stage = 3 if odc is None else "odc"
        result[mode] = {
            "reads": contract_workloads.gradient_reads_before_step(stage, COUNTS, {"odc": odc} if odc else None),
            "zero_grad": contract_workloads.zero_grad_between_backward_and_step(stage, True, odc),
            "writes": contract_workloads.collective_writes(stage, odc),
        }
    return result
