#!/usr/bin/env python3
"""Check, without a GPU, that the push kernel's generated code is what ops/csrc/odc_kernels.cu means.

    python scripts/check_push_kernel.py                 # PTX (nvcc) and, where cuobjdump is found, SASS
    python scripts/check_push_kernel.py --show fp32     # also print the main loop of those kernels

Why: a push runs at memory bandwidth only if each thread keeps several loads in flight before it issues
their reductions (the kernel's comment says why). An ``asm volatile`` with a ``"memory"`` clobber, or a
loop the compiler does not unroll, silently turns that back into one load, one reduction, one load...
This script compiles the kernels for sm_80 and sm_90 and reads, for every instantiation
(fp32/bf16/fp16 gradient into fp32/fp64 accumulator, vector or scalar source loads), the body of its
main loop: how many global loads come before the first reduction (expected: ``UNROLL`` vector loads,
or ``UNROLL * 4`` scalar ones), whether a fence or memory barrier sits in it, and on sm_90 whether the
fp32 reductions are 16-byte vector ones (``red...v4.f32`` / ``REDG.E.ADD.F32x4``).

SASS needs ``cuobjdump`` and ``nvdisasm`` (CUDA toolkit, or the PyPI wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm: point ``CUOBJDUMP`` at the binary). Exits 1 when a check fails, 2 without nvcc.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "ops", "csrc", "odc_kernels.cu")
UNROLL = 4  # ds_odc.comm.push_plan.UNROLL (not imported: this script needs no torch)
ARCHS = ("80", "90")
_MANGLED = re.compile(r"scatter_add_kernelI(?P<src>f|13__nv_bfloat16|6__half)(?P<acc>[fd])Lb(?P<vector>[01])E")
_SRC = {"f": "fp32", "13__nv_bfloat16": "bf16", "6__half": "fp16"}


@dataclass
class Loop:
    kernel: str
    loads_before_first_reduction: int
    load_width_bits: int
    reductions: int
    vector_reductions: int
    fences: int
    text: str


def kernel_name(mangled: str) -> Optional[str]:
    """'fp32->fp32 vector' for a mangled instantiation name, None for anything else."""
    match = _MANGLED.search(mangled)
    if not match:
        return None
    acc = "fp32" if match["acc"] == "f" else "fp64"
    return f"{_SRC[match['src']]}->{acc} {'vector' if match['vector'] == '1' else 'scalar'}"


def _nvcc() -> Optional[str]:
    return shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)


def compile_to(kind: str, arch: str, out_dir: str, source: str = SOURCE) -> str:
    """``nvcc -ptx`` or ``-cubin`` of the kernels for ``sm_<arch>``; returns the file written."""
    out = os.path.join(out_dir, f"odc_kernels_sm{arch}.{kind}")
    include = os.path.dirname(SOURCE)  # odc_kernels.h, also for a copy of the source elsewhere
    subprocess.run([_nvcc(), "-std=c++17", "-O3", f"-arch=sm_{arch}", f"-{kind}", "-I", include, "-o", out, source],
                   check=True, capture_output=True, text=True)
    return out


def _bodies(text: str, header: re.Pattern) -> Dict[str, str]:
    """Kernel name -> its text, from its function header to the next one."""
    matches = list(header.finditer(text))
    ends = [m.start() for m in matches[1:]] + [len(text)]
    return {kernel_name(m[1]): text[m.end():end] for m, end in zip(matches, ends) if kernel_name(m[1])}


def ptx_loops(ptx: str) -> List[Loop]:
    """The main loop of each instantiation in PTX: from the first ``ld.global`` to the loop's back branch
    (the first ``bra`` that jumps to a label above it)."""
    loops = []
    for name, body in _bodies(ptx, re.compile(r"\.entry\s+(\S+)\(")).items():
        lines = body.splitlines()
        labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if line.strip().endswith(":")}
        back = next((i for i, line in enumerate(lines) if (m := re.search(r"\bbra(?:\.uni)?\s+(\S+);", line))
                     and labels.get(m[1], len(lines)) < i), len(lines))
        loop = lines[:back + 1]
        loads = [i for i, line in enumerate(loop) if re.search(r"\bld\.global", line)]
        reds = [i for i, line in enumerate(loop) if re.search(r"\bred\.", line)]
        first_red = reds[0] if reds else len(loop)
        widths = [_ptx_width(loop[i]) for i in loads if i < first_red]
        loops.append(Loop(name, sum(i < first_red for i in loads), max(widths, default=0), len(reds),
                          sum(".v4.f32" in loop[i] for i in reds),
                          sum(bool(re.search(r"\b(membar|fence)\.", line)) for line in loop), "\n".join(loop)))
    return loops


def _ptx_width(line: str) -> int:
    vector = re.search(r"\.v(\d)\.(?:[a-z])(\d+)", line)
    if vector:
        return int(vector[1]) * int(vector[2])
    scalar = re.search(r"ld\.global(?:\.\w+)*\.[a-z](\d+)", line)
    return int(scalar[1]) if scalar else 0


def sass_loops(sass: str) -> List[Loop]:
    """The same reading of cuobjdump's SASS: loads (LDG) before the first reduction (RED), up to the
    loop's backward branch."""
    loops = []
    for name, body in _bodies(sass, re.compile(r"Function : (\S+)")).items():
        lines = [line for line in body.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", line)]
        address = [int(re.search(r"/\*([0-9a-f]{4})\*/", line)[1], 16) for line in lines]
        branch = re.compile(r"\bBRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))")
        back = next((i for i, line in enumerate(lines)
                     if (m := branch.search(line)) and m[1] and int(m[1], 16) < address[i]), len(lines) - 1)
        loop = lines[:back + 1]
        loads = [i for i, line in enumerate(loop) if re.search(r"\bLDG\b", line)]
        reds = [i for i, line in enumerate(loop) if re.search(r"\bREDG?\b", line)]
        first_red = reds[0] if reds else len(loop)
        widths = [_sass_width(loop[i]) for i in loads if i < first_red]
        loops.append(Loop(name, sum(i < first_red for i in loads), max(widths, default=0), len(reds),
                          sum("F32x4" in loop[i] for i in reds),
                          sum(bool(re.search(r"\b(MEMBAR|FENCE)\b", line)) for line in loop), "\n".join(loop)))
    return loops


def _sass_width(line: str) -> int:
    suffixes = re.search(r"LDG((?:\.[\w]+)*)", line)[1].split(".")
    return next((int(x.lstrip("USF")) for x in suffixes if x.lstrip("USF") in ("8", "16", "64", "128")), 32)


def problems(loops: List[Loop], arch: str, what: str) -> List[str]:
    """What in ``loops`` is not what the kernel means (empty: all as meant)."""
    found = []
    if len(loops) != 12:
        found.append(f"{what} sm_{arch}: {len(loops)} kernel instantiations, expected 12")
    for loop in loops:
        vector = loop.kernel.endswith("vector")
        scalar_loads = 1 if vector else 4
        if loop.loads_before_first_reduction < UNROLL * scalar_loads:
            found.append(f"{what} sm_{arch} {loop.kernel}: {loop.loads_before_first_reduction} loads before the first "
                         f"reduction, expected {UNROLL * scalar_loads}")
        if loop.fences:
            found.append(f"{what} sm_{arch} {loop.kernel}: {loop.fences} fence/membar in the main loop")
        if vector and loop.kernel.startswith("fp32") and loop.load_width_bits != 128:
            found.append(f"{what} sm_{arch} {loop.kernel}: loads of {loop.load_width_bits} bits, expected 128")
        vector_reds = arch >= "90" and "->fp32" in loop.kernel
        if vector_reds and loop.vector_reductions < UNROLL:
            found.append(f"{what} sm_{arch} {loop.kernel}: {loop.vector_reductions} 16-byte vector reductions in "
                         f"the main loop, expected {UNROLL}")
    return found


def cuobjdump() -> Optional[str]:
    found = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    return found if found and os.path.exists(found) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--show", help="print the main loop of the kernels whose name contains this")
    args = parser.parse_args(argv)
    if not _nvcc():
        print("check_push_kernel: nvcc not found; nothing checked", file=sys.stderr)
        return 2
    tool, failures = cuobjdump(), []
    with tempfile.TemporaryDirectory() as scratch:
        for arch in ARCHS:
            readings = [("PTX", ptx_loops(open(compile_to("ptx", arch, scratch)).read()))]
            if tool:
                env = {**os.environ, "PATH": os.path.dirname(tool) + os.pathsep + os.environ.get("PATH", "")}
                sass = subprocess.run([tool, "-sass", compile_to("cubin", arch, scratch)], capture_output=True,
                                      text=True, check=True, env=env).stdout
                readings.append(("SASS", sass_loops(sass)))
            for what, loops in readings:
                failures += problems(loops, arch, what)
                for loop in sorted(loops, key=lambda x: x.kernel):
                    print(f"sm_{arch} {what:4} {loop.kernel:22} loads before the first reduction: "
                          f"{loop.loads_before_first_reduction:2} ({loop.load_width_bits}-bit), "
                          f"reductions in the loop: {loop.reductions:2} ({loop.vector_reductions} x 16-byte), "
                          f"fences: {loop.fences}")
                    if args.show and args.show in loop.kernel:
                        print(loop.text)
    if not tool:
        print("check_push_kernel: no cuobjdump (set CUOBJDUMP): the SASS was not read, only the PTX")
    print("\n".join(failures) or "check_push_kernel: every instantiation issues its loads before its reductions")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
