"""The Hugging Face Trainer with ``ParallelismConfig(sp_size=2, sp_backend="deepspeed")`` (ALST through
accelerate) and the balance block, on 4 CPU ranks = 2 SP groups of 2: the plan is made per SP group, both
ranks of a group run its micro-batches on their halves of each sequence, and the groups run different
numbers of micro-batches. Compared with the same Trainer on ZeRO-3 + SP, fed the same planned samples with
equal counts ("lb-micro"): the same samples every step, the same logged losses, the same weights."""
import pytest

from tests.support import hf_sp_workloads as hf_sp
from tests.support.harness import run_ranks

TOKEN_CAP = 26  # no two samples share a micro-batch (packing would let sdpa attend across them)


def test_the_balance_block_with_sp_groups_at_different_counts_matches_zero3_with_sp():
    zero3 = run_ranks(hf_sp.sp_trainer_run, 4, 3, TOKEN_CAP, timeout=400)
    odc = run_ranks(hf_sp.sp_trainer_run, 4, "odc", TOKEN_CAP, timeout=400)
    assert {r["engine"] for r in odc} == {"ODCEngine"}
    assert hf_sp.samples_per_step(odc) == hf_sp.samples_per_step(zero3)  # 8 samples a step, the same ones
    steps = sorted({step for step, _, _ in odc[0]["forwards"]})
    counts = [[sum(1 for step, _, _ in odc[rank]["forwards"] if step == s) for s in steps] for rank in range(4)]
    assert counts[0] == counts[1] and counts[2] == counts[3]  # the ranks of an SP group: the same micro-batches
    assert counts[0] != counts[2], counts  # the groups: different counts (5 and 3 in a step)
    for rank in range(4):
        assert odc[rank]["losses"] == pytest.approx(zero3[rank]["losses"], rel=1e-6)
        assert zero3[rank]["grad_norms"] and odc[rank]["grad_norms"] == pytest.approx(zero3[rank]["grad_norms"],
                                                                                      rel=1e-5)  # the scale
        worst = max(float((odc[rank]["final"][n] - zero3[rank]["final"][n]).abs().max()) for n in zero3[rank]["final"])
        assert worst <= 1e-5, (rank, worst)


def test_padded_micro_batches_are_refused_by_name_on_every_rank():
    """Ulysses attention is built for micro-batches of per_device_train_batch_size sequences: a planned
    micro-batch of several padded sequences cannot run; the refusal says to pack."""
    results = run_ranks(hf_sp.sp_trainer_run, 4, "odc", 2 * TOKEN_CAP, 1, False, timeout=300)
    for result in results:
        assert "needs packed micro-batches" in result["error"] and "DataCollatorWithFlattening" in result["error"]
