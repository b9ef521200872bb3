#!/usr/bin/env python3
"""Prebuild ds_odc's CUDA operator for the GPU machine, here, without a GPU (step 1 of the kit calls it).

    .venv/bin/python scripts/prebuild_cuda_op.py --out .gpu_kit/ops

Why: the GPU machine is lent for 15 minutes; a first JIT build there costs 30-60 s of them and, killed by
a timeout, used to leave a lock behind. So the kit carries the operator built for the machine's software
(torch 2.11.0+cu130, CPython 3.12, sm_80 and sm_90) with a fingerprint, and the kit there loads it when
the fingerprint matches and builds only when it does not, saying which happened
(``scripts/gpu_validation/cuda_op.py``).

How, with no CUDA torch here: torch 2.11's Linux wheel (the cu130 build) is fetched once into
``.gpu_build/wheels`` (git-ignored; ~530 MB) and only its headers and the six libraries the operator links
against are unpacked. The two sources are compiled with the flags ``torch.utils.cpp_extension.load`` uses
for them in torch 2.11 (read from its ``cpp_extension.py``: ``COMMON_NVCC_FLAGS``, ``-std=c++17``,
``-DTORCH_EXTENSION_NAME``, ``-DTORCH_API_INCLUDE_EXTENSION_H``; no pybind11 ABI flags in 2.11) plus
``ops_builder``'s ``-O3``, and linked as it links (``-lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -ltorch
-ltorch_python -lcudart``). Then every undefined symbol of the result must be defined by those libraries,
libcudart 13, libpython3.12 or a versioned glibc/libstdc++ symbol: what ``import`` would need there.

Writes ``<out>/ds_odc_cuda_ipc.so`` and ``<out>/PREBUILT.json`` (the fingerprint: the sources' hash as
``ops_builder`` computes it, the torch tag of its cache folders, the architectures, nvcc, the newest glibc
and libstdc++ versions it needs, the file's sha256). Exits 0 with a note and writes nothing where it cannot
build (no nvcc 13.0, no CPython 3.12 headers): the GPU machine then builds the operator itself.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TORCH = "2.11.0"
CUDA = "13.0"
PYTHON = (3, 12)
ARCHS = ("8.0", "9.0")
LIBS = ("c10", "c10_cuda", "torch_cpu", "torch_cuda", "torch", "torch_python")
NVCC_FLAGS = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")
SYSTEM_VERSIONS = re.compile(r"@+(GLIBC|GLIBCXX|CXXABI|GCC)_([0-9.]+)")


def say(message: str) -> None:
    print(f"prebuild_cuda_op: {message}", flush=True)


def torch_wheel(build: str) -> str:
    """torch 2.11.0's CPython 3.12 x86-64 wheel in ``build/wheels``, fetched with pip once."""
    pattern = os.path.join(build, "wheels", f"torch-{TORCH}-cp312-cp312-manylinux*_x86_64.whl")
    found = sorted(glob.glob(pattern))
    if not found:
        say(f"downloading torch {TORCH} (cp312, x86-64; ~530 MB, once) into {build}/wheels")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "-d", os.path.join(build, "wheels"), f"torch=={TORCH}"], check=True)
        found = sorted(glob.glob(pattern))
    return found[-1]


def unpack(wheel: str, target: str) -> str:
    """torch/include, the linked libraries and torch/version.py, unpacked once; returns ``target/torch``."""
    stamp = os.path.join(target, ".unpacked")
    if not os.path.exists(stamp) or open(stamp).read() != os.path.basename(wheel):
        shutil.rmtree(target, ignore_errors=True)
        wanted = {f"torch/lib/lib{name}.so" for name in LIBS} | {"torch/version.py", "torch/utils/cpp_extension.py"}
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.startswith("torch/include/") or m in wanted]
            archive.extractall(target, members)
        with open(stamp, "w") as out:
            out.write(os.path.basename(wheel))
    return os.path.join(target, "torch")


def version_of(torch_dir: str) -> dict:
    scope: dict = {}
    exec(open(os.path.join(torch_dir, "version.py")).read(), scope)  # noqa: S102 - the wheel's own two constants
    return {"torch": scope["__version__"], "cuda": scope["cuda"]}


def python_include() -> str:
    """Python.h of a CPython 3.12 on this machine (``PY312`` or the first ``python3.12`` that runs)."""
    candidates = [os.environ.get("PY312"), shutil.which("python3.12")] + sorted(
        glob.glob(os.path.expanduser("~/.pyenv/versions/3.12.*/bin/python3")), reverse=True)
    for python in filter(None, candidates):
        done = subprocess.run([python, "-c", "import sys, sysconfig; assert sys.version_info[:2] == (3, 12); "
                               "print(sysconfig.get_path('include'))"], capture_output=True, text=True)
        path = done.stdout.strip()
        if done.returncode == 0 and os.path.exists(os.path.join(path, "Python.h")):
            return path
    return ""


def nvcc() -> tuple:
    """(path, version) of nvcc: CUDA_HOME's, else the one on PATH (resolved through a wrapper script)."""
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    path = os.path.join(home, "bin", "nvcc")
    path = path if os.path.exists(path) else shutil.which("nvcc")
    if not path:
        return None, None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release ([0-9.]+), V([0-9.]+)", out)
    return path, (match.group(2) if match else None)


def run(argv) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"prebuild_cuda_op: failed ({done.returncode}): {' '.join(argv)}\n{done.stdout}{done.stderr}")


def build(torch_dir: str, py_include: str, nvcc_path: str, out_dir: str, scratch: str) -> str:
    from ds_odc.ops_builder import CUDA_IPC, OPS_DIR

    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc_path)))
    include = os.path.join(torch_dir, "include")
    common = [f"-DTORCH_EXTENSION_NAME={CUDA_IPC.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
              f"-I{OPS_DIR / 'csrc'}", "-isystem", include, "-isystem",
              os.path.join(include, "torch", "csrc", "api", "include"), "-isystem", os.path.join(cuda_home, "include"),
              "-isystem", py_include]
    gencode = [f"-gencode=arch=compute_{a.replace('.', '')},code=sm_{a.replace('.', '')}" for a in ARCHS]
    os.makedirs(scratch, exist_ok=True)
    kernels, binding = os.path.join(scratch, "odc_kernels.cuda.o"), os.path.join(scratch, "odc_ops.o")
    run([nvcc_path, *common, *NVCC_FLAGS, *gencode, "--compiler-options", "-fPIC", "-O3", "-std=c++17", "-c",
         str(OPS_DIR / "csrc" / "odc_kernels.cu"), "-o", kernels])
    run([os.environ.get("CXX", "c++"), *common, "-fPIC", "-std=c++17", "-O3", "-c",
         str(OPS_DIR / "csrc" / "odc_ops.cpp"), "-o", binding])
    library = os.path.join(out_dir, f"{CUDA_IPC.name}.so")
    run([os.environ.get("CXX", "c++"), kernels, binding, "-shared", f"-L{os.path.join(torch_dir, 'lib')}",
         *[f"-l{name}" for name in LIBS], f"-L{os.path.join(cuda_home, 'lib64')}", "-lcudart", "-o", library])
    return library


def dynamic_symbols(path: str, defined: bool) -> set:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, path], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return {row[-1] for row in rows if row[-2] not in ("w", "v")}  # weak symbols may stay undefined


def check_symbols(library: str, torch_dir: str, nvcc_path: str, py_include: str) -> dict:
    """Every undefined symbol must come from torch's libraries, libcudart, libpython3.12 or a versioned
    system library; returns the newest glibc / libstdc++ versions needed. Raises naming the rest."""
    cuda_home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc_path)))
    providers = [os.path.join(torch_dir, "lib", f"lib{name}.so") for name in LIBS]
    providers += glob.glob(os.path.join(cuda_home, "lib64", "libcudart.so.*"))[:1]
    libpython = glob.glob(os.path.join(os.path.dirname(os.path.dirname(py_include)), "lib", "libpython3.12.so*"))
    providers += libpython[:1]
    defined = set()
    for provider in providers:
        defined |= {symbol.split("@")[0] for symbol in dynamic_symbols(provider, True)}
    undefined = dynamic_symbols(library, False)
    needed, system = [], {}
    for symbol in undefined:
        name = symbol.split("@")[0]
        versioned = SYSTEM_VERSIONS.search(symbol)
        if versioned:
            key, version = versioned.group(1), versioned.group(2)
            if tuple(map(int, version.split("."))) > tuple(map(int, system.get(key, "0").split("."))):
                system[key] = version
        elif name not in defined and not (not libpython and name.startswith(("Py", "_Py"))):
            needed.append(symbol)
    if needed:
        raise SystemExit(f"prebuild_cuda_op: {len(needed)} symbols of {library} are defined nowhere it will be "
                         f"loaded: {sorted(needed)[:20]}")
    return {"undefined_symbols": len(undefined), "newest_system_versions": system}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, ".gpu_kit", "ops"))
    parser.add_argument("--build", default=os.path.join(ROOT, ".gpu_build"), help="scratch (git-ignored)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    nvcc_path, nvcc_version = nvcc()
    py_include = python_include()
    missing = ([] if nvcc_path and nvcc_version and nvcc_version.startswith(CUDA + ".") else
               [f"nvcc {CUDA} (found {nvcc_version or 'none'})"]) + ([] if py_include else ["CPython 3.12's Python.h"])
    if missing:
        say(f"not prebuilt: no {' and no '.join(missing)} here; the GPU machine will build the operator itself")
        return 0
    torch_dir = unpack(torch_wheel(args.build), os.path.join(args.build, f"torch-{TORCH}"))
    versions = version_of(torch_dir)
    if versions != {"torch": f"{TORCH}+cu{CUDA.replace('.', '')}", "cuda": CUDA}:
        raise SystemExit(f"prebuild_cuda_op: the wheel is torch {versions}, expected {TORCH}+cu130 with CUDA {CUDA}")
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    say(f"building for torch {versions['torch']}, CPython 3.12, sm_{' sm_'.join(a.replace('.', '') for a in ARCHS)} "
        f"with nvcc {nvcc_version}")
    library = build(torch_dir, py_include, nvcc_path, args.out, os.path.join(args.build, "prebuild"))
    symbols = check_symbols(library, torch_dir, nvcc_path, py_include)
    from ds_odc.ops_builder import CUDA_IPC

    with open(library, "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    fingerprint = {"op": CUDA_IPC.name, "library": os.path.basename(library), "sha256": digest,
                   "bytes": os.path.getsize(library), "sources": CUDA_IPC.fingerprint(),
                   "torch_tag": f"py{PYTHON[0]}{PYTHON[1]}_torch{TORCH}_cu{CUDA.replace('.', '')}",
                   "torch": versions["torch"], "archs": list(ARCHS), "nvcc": nvcc_version, "commit": commit,
                   "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **symbols}
    with open(os.path.join(args.out, "PREBUILT.json"), "w") as out:
        json.dump(fingerprint, out, indent=1)
    say(f"{library}: {fingerprint['bytes'] / 1e6:.1f} MB, sources {fingerprint['sources']}, "
        f"{fingerprint['torch_tag']}, needs {symbols['newest_system_versions']} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
