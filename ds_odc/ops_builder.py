"""Builder of ds_odc's compiled operators: JIT-compiled with ninja on first use, cached, never at import.

There is one operator today, ``cuda_ipc`` (``ops/csrc``): CUDA IPC windows and the fp32/fp64
scatter-accumulate kernel that the ``cuda_ipc`` transport pushes with. It is compiled by
``torch.utils.cpp_extension.load`` the first time a CUDA IPC transport allocates its windows, into
a cache directory named after the sources' hash, torch's version and its CUDA version, so a
changed source or a new torch rebuilds it and an unchanged one is loaded in a fraction of a second.
Concurrent ranks building at once are serialised by torch's lock file in that directory.

Nothing here runs at ``import ds_odc``: importing never needs nvcc, CUDA or ninja. Where to cache:
``TORCH_EXTENSIONS_DIR`` (torch's own setting) or ``~/.cache/torch_extensions``, under ``ds_odc/``.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import List

OPS_DIR = Path(__file__).resolve().parent.parent / "ops"


@dataclass(frozen=True)
class OpSpec:
    """One JIT-built operator: its module name and its sources under ``ops/``."""

    name: str
    sources: tuple
    headers: tuple = ()
    needs_cuda: bool = True

    def source_paths(self) -> List[Path]:
        return [OPS_DIR / s for s in self.sources]

    def fingerprint(self) -> str:
        """Hash of every source and header: part of the cache directory's name."""
        digest = hashlib.sha256()
        for rel in self.sources + self.headers:
            path = OPS_DIR / rel
            digest.update(rel.encode())
            digest.update(path.read_bytes() if path.exists() else b"<missing>")
        return digest.hexdigest()[:12]


CUDA_IPC = OpSpec("ds_odc_cuda_ipc", sources=("csrc/odc_ops.cpp", "csrc/odc_kernels.cu"),
                  headers=("csrc/odc_kernels.h",))
OPS = (CUDA_IPC,)

_loaded: dict = {}
_load_lock = threading.Lock()


def _torch_tag() -> str:
    import torch

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return f"{python}_torch{torch.__version__.split('+')[0]}_cu{(torch.version.cuda or 'none').replace('.', '')}"


def build_directory(spec: OpSpec) -> Path:
    """Where ``spec`` is (or will be) built:
    ``$TORCH_EXTENSIONS_DIR/ds_odc/ds_odc_cuda_ipc_<source hash>_py311_torch2.13.0_cu128``."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / "ds_odc" / f"{spec.name}_{spec.fingerprint()}_{_torch_tag()}"


def _library_path(spec: OpSpec) -> Path:
    return build_directory(spec) / f"{spec.name}.so"


def why_not_buildable(spec: OpSpec) -> str:
    """Empty string if ``spec`` can be compiled here, else the first reason it cannot."""
    import torch

    missing = [str(p) for p in spec.source_paths() if not p.exists()]
    if missing:
        return f"sources missing: {', '.join(missing)} (a wheel without ops/? reinstall from the repository)"
    if spec.needs_cuda:
        if torch.version.cuda is None:
            return f"torch {torch.__version__} is a CPU-only build (torch.version.cuda is None)"
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None:
            return "no CUDA toolkit found (set CUDA_HOME, or put nvcc on PATH)"
        if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            return ("no CUDA device visible and TORCH_CUDA_ARCH_LIST unset: the target GPU architecture "
                    "is unknown")
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler found (set CXX)"
    return ""


def op_status() -> List[dict]:
    """State of every operator, for ``python -m ds_odc report``; never builds anything.

    Each entry: ``name``; ``built`` (compiled for these sources and this torch, or loaded in this
    process); ``buildable`` (it could be compiled here now); ``reason`` (why not buildable, else "").
    """
    status = []
    for spec in OPS:
        reason = why_not_buildable(spec)
        try:
            built = spec.name in _loaded or _library_path(spec).exists()
        except Exception as err:  # noqa: BLE001 - a report must not fail on a broken cache path
            built, reason = False, reason or f"cannot inspect the build cache: {err}"
        status.append({"name": spec.name, "built": bool(built), "buildable": not reason, "reason": reason})
    return status


def load_op(spec: OpSpec = CUDA_IPC, *, verbose: bool = False):
    """The compiled module of ``spec``, building it with ninja on first use (minutes, once per cache).

    Raises :class:`RuntimeError` naming the reason when it cannot be built here."""
    with _load_lock:
        if spec.name in _loaded:
            return _loaded[spec.name]
        reason = why_not_buildable(spec)
        if reason:
            raise RuntimeError(f"ds_odc operator {spec.name!r} cannot be built here: {reason}")
        directory = build_directory(spec)
        directory.mkdir(parents=True, exist_ok=True)
        library = _library_path(spec)
        building = (directory / "lock").exists()  # torch's baton: another rank is compiling right now
        if library.exists() and not building:
            module = _import_built(spec.name, library)
        else:
            from torch.utils.cpp_extension import load

            module = load(name=spec.name, sources=[str(p) for p in spec.source_paths()],
                          extra_include_paths=[str(OPS_DIR / "csrc")], extra_cuda_cflags=["-O3"],
                          extra_cflags=["-O3"], build_directory=str(directory), verbose=verbose)
        _loaded[spec.name] = module
        return module


def _import_built(name: str, library: Path):
    """Import an already-built extension without invoking ninja (no lock file, no compiler)."""
    import torch  # noqa: F401  the extension links against torch's libraries, loaded by this import

    loader_spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
