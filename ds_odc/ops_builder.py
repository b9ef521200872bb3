"""Builder of ds_odc's compiled operators: JIT-compiled with ninja on first use, cached, never at import.

Two operators (``ops/csrc``):

* ``ds_odc_atomics``: release/acquire stores and loads of the 64-bit control words of the step
  rendezvous (plain C, no torch headers, built in about a second, called through ctypes). Built
  the first time a transport allocates its windows (``make venv`` builds it ahead);
* ``ds_odc_cuda_ipc``: CUDA IPC windows and the fp32/fp64 scatter-accumulate kernel that the
  ``cuda_ipc`` transport pushes with, built the first time a CUDA IPC transport allocates.

Each is compiled by ``torch.utils.cpp_extension.load`` into a cache directory named after the
sources' hash, torch's version and its CUDA version, so a changed source or a new torch rebuilds it
and an unchanged one is loaded in a fraction of a second. Concurrent ranks building at once are
serialised by torch's lock file in that directory; a lock file older than the operator's longest
plausible build was left by a build that was killed, and is removed (torch would wait on it forever).

Where the sources are (:func:`find_ops_dir`): an installed package carries them in ``ds_odc/ops/csrc``
(``setup.py`` copies them there when it builds a wheel), a checkout or an editable install has them in
the repository's ``ops/csrc``. ``python -m ds_odc report`` names the directory it found.

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


def find_ops_dir() -> Path:
    """The directory holding ``csrc/`` with the operators' sources: ``<package>/ops`` in an installed
    wheel, ``<repository>/ops`` in a checkout (or an editable install of one). When neither has them
    (a broken install), the installed location, so that :func:`why_not_buildable` names it."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "ops", package.parent / "ops"):
        if (candidate / "csrc").is_dir():
            return candidate
    return package / "ops"


OPS_DIR = find_ops_dir()


@dataclass(frozen=True)
class OpSpec:
    """One JIT-built operator: its module name and its sources under ``ops/``."""

    name: str
    sources: tuple
    headers: tuple = ()
    needs_cuda: bool = True
    python_module: bool = True
    """False: plain C functions, loaded with ctypes (no pybind11, no torch headers)."""
    stale_lock_s: float = 1800.0
    """A build lock older than this was left by a killed build (see the module docstring)."""

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
ATOMICS = OpSpec("ds_odc_atomics", sources=("csrc/odc_atomics.cpp",), needs_cuda=False, python_module=False,
                 stale_lock_s=120.0)
OPS = (ATOMICS, CUDA_IPC)

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
        return f"sources missing: {', '.join(missing)} (a wheel without ds_odc/ops/csrc? reinstall from the repository)"
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
    process); ``buildable`` (it could be compiled here now); ``reason`` (why not buildable, else "");
    ``sources`` (the directory its sources are read from, see :func:`find_ops_dir`).
    """
    status = []
    for spec in OPS:
        reason = why_not_buildable(spec)
        try:
            built = spec.name in _loaded or _library_path(spec).exists()
        except Exception as err:  # noqa: BLE001 - a report must not fail on a broken cache path
            built, reason = False, reason or f"cannot inspect the build cache: {err}"
        status.append({"name": spec.name, "built": bool(built), "buildable": not reason, "reason": reason,
                       "sources": str(spec.source_paths()[0].parent)})
    return status


def load_op(spec: OpSpec = CUDA_IPC, *, verbose: bool = False):
    """The compiled module of ``spec`` (a ``ctypes.CDLL`` for plain-C operators), building it with
    ninja on first use (seconds to minutes, once per cache).

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
        _remove_stale_lock(directory / "lock", spec.stale_lock_s)
        building = (directory / "lock").exists()  # torch's baton: another rank is compiling right now
        if library.exists() and not building:
            module = _import_built(spec, library)
        else:
            from torch.utils.cpp_extension import load

            built = load(name=spec.name, sources=[str(p) for p in spec.source_paths()],
                         extra_include_paths=[str(OPS_DIR / "csrc")], extra_cuda_cflags=["-O3"],
                         extra_cflags=["-O3"], build_directory=str(directory), verbose=verbose,
                         is_python_module=spec.python_module)
            module = built if spec.python_module else _import_built(spec, library)
        _loaded[spec.name] = module
        return module


def _remove_stale_lock(lock: Path, older_than_s: float) -> None:
    import time

    try:
        if time.time() - lock.stat().st_mtime > older_than_s:
            lock.unlink()
    except FileNotFoundError:
        pass


def _import_built(spec: OpSpec, library: Path):
    """Import an already-built extension without invoking ninja (no lock file, no compiler)."""
    import torch  # noqa: F401  the extension links against torch's libraries, loaded by this import

    name = spec.name
    if not spec.python_module:
        import ctypes

        return ctypes.CDLL(str(library))
    loader_spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
