"""Deterministic accumulation ([Note: exact sums] in ds_odc/runtime/exact_sum.py): each pushed value cut into two
parts on fixed grids, summed exactly in two fp64 regions, folded once per fence. The sums do not depend on the
order pushes arrive in, where fp32's (and fp64's) do; a push after a gradient read in the same step is refused."""
import threading

import pytest
import torch

from ds_odc.config import parse_options
from ds_odc.errors import ODCConfigError
from ds_odc.runtime import LossNormalization, MicroBatchLedger, ODCRuntime
from ds_odc.runtime.exact_sum import COARSE_BITS, FINE_BITS, split
from ds_odc.runtime.layout import WindowLayout
from tests.support.loopback import LoopbackGroup, Update


def _hard_values(seed: int = 0) -> torch.Tensor:
    """Addends of one element over a step: a wide dynamic range and cancellations."""
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.randn(300, generator=g) * 1e-3, torch.randn(200, generator=g) * 1e-9,
                      torch.randn(40, generator=g) * 50.0, torch.randn(60, generator=g) * 1e-16]).float()


def test_the_parts_sit_on_their_grids_and_add_up_to_the_value():
    values = _hard_values()
    coarse, fine = split(values)
    assert coarse.dtype == fine.dtype == torch.float64
    assert torch.equal(torch.round(coarse * 2.0 ** COARSE_BITS), coarse * 2.0 ** COARSE_BITS)
    assert torch.equal(torch.round(fine * 2.0 ** FINE_BITS), fine * 2.0 ** FINE_BITS)
    assert float(fine.abs().max()) <= 2.0 ** -(COARSE_BITS + 1)
    assert float(((coarse + fine) - values.double()).abs().max()) <= 2.0 ** -(FINE_BITS + 1)


def test_exact_sums_are_one_value_in_every_order_where_fp32_and_fp64_sums_are_not():
    values = _hard_values()
    coarse, fine = split(values)
    exact, fp32, fp64 = set(), set(), set()
    g = torch.Generator().manual_seed(1)
    for _ in range(40):
        order = torch.randperm(len(values), generator=g)
        c, f = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        a32, a64 = torch.zeros(()), torch.zeros((), dtype=torch.float64)
        for i in order:
            c += coarse[i]
            f += fine[i]
            a32 += values[i]
            a64 += values[i].double()
        exact.add(float(c + f))
        fp32.add(float(a32))
        fp64.add(float(a64))
    assert len(exact) == 1 and len(fp32) > 1 and len(fp64) > 1, (len(exact), len(fp32), len(fp64))
    assert exact.pop() == pytest.approx(float(values.double().sum()), rel=1e-12)


def _exact_runtime(transport, numel: int, exact: bool = True) -> ODCRuntime:
    layout = WindowLayout()
    layout.add_trainable(0, numel * transport.world_size, numel)
    return ODCRuntime(transport, layout, MicroBatchLedger(), exact=exact)


def _step_in_order(order: list[int], numel: int = 8, exact: bool = True) -> list[torch.Tensor]:
    """3 ranks push the same gradients, one at a time in ``order``; returns each owner's folded gradient (fp32
    accumulators with ``exact`` False)."""
    world = len(order)
    group = LoopbackGroup(world, param_numel=numel, grad_numel=(2 if exact else 1) * numel,
                          grad_dtype=torch.float64 if exact else torch.float32)
    turns = [threading.Event() for _ in range(world + 1)]
    turns[0].set()
    values = _hard_values(seed=2)[: world * numel * world].reshape(world, world * numel)

    class Keep(Update):
        def apply(self, norms):
            self.kept = self.transport.local_grad_accumulator()[:numel].clone()

    def rank_fn(rank, transport):
        runtime = _exact_runtime(transport, numel, exact)
        runtime.open()  # the open round is collective: before the pushes take turns
        position = order.index(rank)
        assert turns[position].wait(10)
        runtime.push(0, values[rank].clone())
        turns[position + 1].set()
        runtime.record_micro_batch(LossNormalization.CALLER)
        update = Keep(transport)
        runtime.step(update)
        return update.kept

    results = group.run(rank_fn)
    assert all(ok for ok, _ in results), results
    return [kept for _, kept in results]


def test_owners_fold_the_same_bits_whatever_order_the_pushes_arrive_in():
    orders = ([0, 1, 2], [2, 1, 0], [1, 2, 0])
    first = _step_in_order(orders[0])
    for order in orders[1:]:
        for owner, (a, b) in enumerate(zip(first, _step_in_order(order))):
            assert torch.equal(a, b), (order, owner, (a - b).abs().max())
    # the same pushes into fp32 accumulators: the order shows in the bits
    runs = [torch.cat(_step_in_order(order, exact=False)) for order in orders]
    assert any(not torch.equal(runs[0], other) for other in runs[1:])


class _Kept(Update):
    def apply(self, norms):
        self.kept = self.transport.local_grad_accumulator()[:4].clone()
        super().apply(norms)


def test_under_exact_sums_a_push_after_a_read_stays_exact_and_the_step_is_the_unread_one_bit_for_bit():
    """Reads no longer fold the live accumulator (they fold their copy), so deterministic accumulation lets
    ranks push after a mid-step read: the step's bits equal a run without the read."""
    def run(read: bool):
        group = LoopbackGroup(2, param_numel=4, grad_numel=8, grad_dtype=torch.float64)
        values = _hard_values(seed=5)[:24].reshape(3, 8)

        def rank_fn(rank, transport):
            runtime = _exact_runtime(transport, 4)
            runtime.push(0, values[rank].clone())
            if read:
                runtime.sync_gradients("engine.allreduce_gradients()")
                runtime.own_gradients().clone()
            if rank == 0:
                runtime.push(0, values[2].clone())
            runtime.record_micro_batch(LossNormalization.CALLER)
            update = _Kept(transport)
            runtime.step(update)
            return update.kept

        results = group.run(rank_fn)
        assert all(ok for ok, _ in results), results
        return [value for _, value in results]

    unread, read = run(False), run(True)
    for owner, (a, b) in enumerate(zip(unread, read)):
        assert torch.equal(a, b), (owner, (a - b).abs().max())


def test_deterministic_follows_torch_unless_told_and_refuses_a_contradiction():
    from ds_odc.integration.zero3_windows import deterministic_sums

    plain, asked, refused = parse_options({}), parse_options({"deterministic": False}), None
    with pytest.raises(ODCConfigError, match="deterministic=true sums into its own accumulator"):
        parse_options({"deterministic": True, "accumulator_dtype": "fp64"})
    before = torch.are_deterministic_algorithms_enabled()
    try:
        assert not deterministic_sums(plain, "cpu")
        torch.use_deterministic_algorithms(True)
        assert deterministic_sums(plain, "cpu") and not deterministic_sums(asked, "cpu")
        with pytest.raises(ODCConfigError, match="accumulator_dtype='fp32' sums pushes in arrival order"):
            deterministic_sums(parse_options({"accumulator_dtype": "fp32"}), "cpu")
        with pytest.raises(ODCConfigError, match="exact sums have run on CPU ranks only") as refused:
            deterministic_sums(plain, "cuda:0")
    finally:
        torch.use_deterministic_algorithms(before)
    assert "set odc.deterministic false" in str(refused.value)
