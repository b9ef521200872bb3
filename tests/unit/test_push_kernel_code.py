"""The push kernel's generated code is what ops/csrc/odc_kernels.cu means (scripts/check_push_kernel.py):
every instantiation issues its UNROLL loads before its reductions, with no fence in the loop, and 16-byte
vector reductions on sm_90. Read from nvcc's PTX (no GPU needed; skipped without nvcc); the SASS is read
too where cuobjdump is found. And the check is not vacuous: the kernel as it was before (one load, then its
reduction behind a "memory" clobber) fails it."""
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import check_push_kernel as check  # noqa: E402

pytestmark = pytest.mark.skipif(check._nvcc() is None, reason="needs nvcc (compiles only: no GPU)")


def test_every_instantiation_keeps_its_loads_in_flight_before_its_reductions(tmp_path):
    from ds_odc.comm.push_plan import UNROLL

    assert check.UNROLL == UNROLL
    for arch in check.ARCHS:
        loops = check.ptx_loops(open(check.compile_to("ptx", arch, str(tmp_path))).read())
        assert check.problems(loops, arch, "PTX") == []
        fp32 = next(loop for loop in loops if loop.kernel == "fp32->fp32 vector")
        assert fp32.loads_before_first_reduction == UNROLL and fp32.load_width_bits == 128
        assert fp32.vector_reductions == (UNROLL if arch == "90" else 0)


def test_a_memory_clobber_and_one_load_per_trip_fail_the_check(tmp_path):
    """The shape the kernel had before: kUnroll 1 and a "memory" clobber on each reduction."""
    source = open(check.SOURCE).read().replace("constexpr int kUnroll = 4;", "constexpr int kUnroll = 1;")
    source = source.replace('"f"(v[3]));', '"f"(v[3]) : "memory");')
    assert '"memory"' in source and "kUnroll = 1;" in source
    copy = tmp_path / "odc_kernels.cu"
    copy.write_text(source)
    loops = check.ptx_loops(open(check.compile_to("ptx", "90", str(tmp_path), str(copy))).read())
    found = check.problems(loops, "90", "PTX")
    assert any("fp32->fp32 vector: 1 loads before the first reduction, expected 4" in p for p in found), found


@pytest.mark.skipif(check.cuobjdump() is None, reason="no cuobjdump (set CUOBJDUMP): SASS not read")
def test_the_sass_says_the_same(tmp_path):
    env_path = os.path.dirname(check.cuobjdump()) + os.pathsep + os.environ.get("PATH", "")
    if shutil.which("nvdisasm", path=env_path) is None:
        pytest.skip("cuobjdump needs nvdisasm beside it or on PATH")
    assert check.main([]) == 0
