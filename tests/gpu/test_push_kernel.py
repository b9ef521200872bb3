"""The push kernel (``ops/csrc/odc_kernels.cu``) against a CPU reference, in one process.

Every gradient dtype (fp32, bf16, fp16) into every accumulator dtype (fp32, fp64), at every alignment
of destination and source (element offsets 0-3, so the head, the vector body, the vector or scalar
source loads and the tail are all taken), every size 0-37; a grid-stride case; and one 3,000,001-element
push at misaligned offsets. One push adds each element once, so the result is exactly
``accumulator + float(gradient)`` rounded once in the accumulator's dtype, which the CPU computes the
same way (inputs are normal numbers: ``red.add.f32`` flushes subnormals). Every element outside the
pushed ranges must be untouched. The plans come from :func:`ds_odc.comm.push_plan.push_plan`, as the
transport makes them. Skipped without CUDA.
"""
import pytest
import torch

from ds_odc.comm.push_plan import push_plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the push kernel needs a CUDA device")

SOURCES = (torch.float32, torch.bfloat16, torch.float16)
ACCUMULATORS = (torch.float32, torch.float64)
OFFSETS = range(4)
SIZES = range(38)
SLOT = 48  # elements per case: 3 offset + 37 pushed + room, so cases never overlap


@pytest.fixture(scope="module")
def ops():
    from ds_odc.ops_builder import CUDA_IPC, load_op

    return load_op(CUDA_IPC)


def _push(ops, dst, src, threads=256, max_blocks=16):
    plan = push_plan(dst.data_ptr(), src.data_ptr(), src.numel(), dst.element_size(), src.element_size(),
                     threads=threads, max_blocks=max_blocks)
    ops.scatter_add(dst, src, plan.head, plan.groups, plan.vector_loads, plan.blocks, plan.threads)
    return plan


def _values(numel, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=generator).to(dtype)


@pytest.mark.parametrize("acc", ACCUMULATORS, ids=["fp32-acc", "fp64-acc"])
@pytest.mark.parametrize("src_dtype", SOURCES, ids=["fp32", "bf16", "fp16"])
def test_every_alignment_and_size_adds_each_element_once(ops, src_dtype, acc):
    cases = [(d, s, n) for d in OFFSETS for s in OFFSETS for n in SIZES]
    initial = _values(len(cases) * SLOT, acc, seed=1)
    source = _values(len(cases) * SLOT, src_dtype, seed=2)
    dst, src = initial.cuda(), source.cuda()
    expected = initial.clone()
    heads = set()
    for k, (dst_offset, src_offset, numel) in enumerate(cases):
        d, s = k * SLOT + dst_offset, k * SLOT + src_offset
        plan = _push(ops, dst[d:d + numel], src[s:s + numel])
        heads.add((plan.head, plan.vector_loads))
        expected[d:d + numel] += source[s:s + numel].to(acc)
    torch.cuda.synchronize()
    got = dst.cpu()
    wrong = (got != expected).nonzero().flatten()
    if len(wrong):
        first = wrong[0].item()
        dst_offset, src_offset, numel = cases[first // SLOT]
        pytest.fail(f"{len(wrong)} wrong elements; first at case dst offset {dst_offset}, src offset {src_offset}, "
                    f"{numel} elements: got {got[first].item()}, expected {expected[first].item()}")
    if acc == torch.float32:  # the sweep did take every head length and both kinds of source load
        assert {h for h, _ in heads} == {0, 1, 2, 3} and {v for _, v in heads} == {True, False}, heads


def test_a_small_grid_strides_over_many_groups(ops):
    """One block of 32 threads over 1,001 elements: each thread loops over several groups and edges."""
    initial, source = _values(1100, torch.float32, 3), _values(1100, torch.bfloat16, 4)
    dst, src = initial.cuda(), source.cuda()
    plan = _push(ops, dst[1:1002], src[3:1004], threads=32, max_blocks=1)
    assert plan.blocks == 1 and plan.groups > 32
    torch.cuda.synchronize()
    expected = initial.clone()
    expected[1:1002] += source[3:1004].float()
    assert torch.equal(dst.cpu(), expected)


@pytest.mark.parametrize("max_blocks", [16, None], ids=["16-blocks", "device-wave"])
def test_one_large_misaligned_push(ops, max_blocks):
    """16 blocks stride over many tiles; ``None`` (the transport's default) plans one block per tile and the
    kernel cuts the grid to one wave of the device: blocks stride over tiles either way."""
    numel = 3_000_001
    initial, source = _values(numel + 8, torch.float32, 5), _values(numel + 8, torch.bfloat16, 6)
    dst, src = initial.cuda(), source.cuda()
    plan = _push(ops, dst[1:1 + numel], src[3:3 + numel], max_blocks=max_blocks)
    assert plan.head == 3 and plan.blocks == (16 if max_blocks else -(-plan.groups // plan.tile_groups))
    torch.cuda.synchronize()
    expected = initial.clone()
    expected[1:1 + numel] += source[3:3 + numel].float()
    assert torch.equal(dst.cpu(), expected)


def test_a_wrong_plan_is_refused_on_the_host_and_the_device_keeps_working(ops):
    """A misaligned vector access would fault the device and end the process's CUDA context; the binding
    must refuse the plan before launching."""
    dst, src = torch.zeros(64, device="cuda"), torch.ones(64, device="cuda")
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        ops.scatter_add(dst[1:33], src[:32], 0, 8, False, 1, 256)  # head 0 leaves the body misaligned
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.scatter_add(dst[:8], src[:8], 0, 3, False, 1, 256)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        ops.scatter_add(dst.half()[:8], src[:8], 0, 0, False, 1, 256)
    _push(ops, dst[:8], src[:8])
    torch.cuda.synchronize()
    assert dst[:8].sum().item() == 8.0 and dst[8:].abs().sum().item() == 0.0
