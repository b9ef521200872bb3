"""Builder of ds_odc's compiled operators: JIT-compiled with ninja on first use, cached, never at import.

Two operators (``ops/csrc``):

* ``ds_odc_atomics``: release/acquire stores and loads of the 64-bit control words of the step
  rendezvous (plain C, no torch headers, built in about a second, called through ctypes). Built
  the first time a transport allocates its windows (``make venv`` builds it ahead);
* ``ds_odc_cuda_ipc``: CUDA IPC windows and the fp32/fp64 scatter-accumulate kernel that the
  ``cuda_ipc`` transport pushes with, built the first time a CUDA IPC transport allocates.

Each is compiled by ``torch.utils.cpp_extension.load`` into a cache directory named after the
sources' hash, torch's version and its CUDA version, so a changed source or a new torch rebuilds it
and an unchanged one is loaded in a fraction of a second.

Concurrent builds (:func:`_builder_lock`): ranks that build at once are serialised by a kernel lock
(``flock``) on ``ds_odc_build.flock`` in that directory, which the kernel releases when its holder dies,
however it dies. torch's own lock file (``lock``, a plain file that torch waits on for as long as it
exists) is therefore stale whenever ds_odc holds the kernel lock and finds it: it was left by a build that
was killed (a rank killed mid-build, a timeout), and is removed at once. (Breaking it only when older than
the longest plausible build made every later build wait on it until its own timeout.) A library that a
killed link left truncated fails to import and is rebuilt under the same lock.

Where the sources are (:func:`find_ops_dir`): an installed package carries them in ``ds_odc/ops/csrc``
(``setup.py`` copies them there when it builds a wheel), a checkout or an editable install has them in
the repository's ``ops/csrc``. ``python -m ds_odc report`` names the directory it found.

Nothing here runs at ``import ds_odc``: importing never needs nvcc, CUDA or ninja. Where to cache:
``TORCH_EXTENSIONS_DIR`` (torch's own setting) or ``~/.cache/torch_extensions``, under ``ds_odc/``.
"""
from __future__ import annotations

import contextlib
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
    build_wait_s: float = 1800.0
    """How long a rank waits for another *live* rank's build of it before giving up with an error."""

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
                 build_wait_s=120.0)
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
        directory = build_directory(spec)
        library = _library_path(spec)
        module = None
        if library.exists() and not (directory / "lock").exists():  # built (or prebuilt), nobody building
            module = _try_import(spec, library)
        if module is None:
            reason = why_not_buildable(spec)
            if reason:
                raise RuntimeError(f"ds_odc operator {spec.name!r} cannot be built here: {reason}")
            directory.mkdir(parents=True, exist_ok=True)
            with _builder_lock(directory, spec):
                module = _build_or_import(spec, directory, library, verbose)
        _loaded[spec.name] = module
        return module


def _build_or_import(spec: OpSpec, directory: Path, library: Path, verbose: bool):
    """Under the builder lock: no live ds_odc build of ``spec`` runs, so torch's lock file is stale."""
    torch_lock = directory / "lock"
    if torch_lock.exists():
        torch_lock.unlink()  # left by a killed build (the module docstring)
    if library.exists():
        module = _try_import(spec, library)
        if module is not None:
            return module
        library.unlink()  # a truncated library from a killed link: build it again
    from torch.utils.cpp_extension import load

    built = load(name=spec.name, sources=[str(p) for p in spec.source_paths()],
                 extra_include_paths=[str(OPS_DIR / "csrc")], extra_cuda_cflags=["-O3"],
                 extra_cflags=["-O3"], build_directory=str(directory), verbose=verbose,
                 is_python_module=spec.python_module)
    return built if spec.python_module else _import_built(spec, library)


@contextlib.contextmanager
def _builder_lock(directory: Path, spec: OpSpec, poll_s: float = 0.1):
    """Exclusive among the processes building ``spec`` into ``directory``; released by the kernel when
    the holder exits, killed or not. Waits up to ``spec.build_wait_s`` for a live holder, then raises
    naming it (its pid is written into the lock file)."""
    import fcntl
    import time

    path = directory / "ds_odc_build.flock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + spec.build_wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                    raise RuntimeError(f"ds_odc operator {spec.name!r}: another process (pid {holder}) has been "
                                       f"building it in {directory} for over {spec.build_wait_s:.0f} s") from None
                time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the last descriptor releases the lock


def _try_import(spec: OpSpec, library: Path):
    """The built library, or None when it does not load (truncated by a killed build)."""
    try:
        return _import_built(spec, library)
    except (ImportError, OSError):
        return None


def _import_built(spec: OpSpec, library: Path):
    """Import an already-built extension without invoking ninja (no lock file, no compiler)."""
    import torch  # noqa: F401  the extension links against torch's libraries, loaded by this import

    name = spec.name
    if not spec.python_module:
        import ctypes

        return ctypes.CDLL(str(library))
    loader_spec = importlib.util.spec_from_file_location(name, library)
    if loader_spec is None or loader_spec.loader is None:
        raise RuntimeError(f"{library}: Python finds no loader for this file name (an extension module's suffix?)")
    module = importlib.util.module_from_spec(loader_spec)
    loader_spec.loader.exec_module(module)
    sys.modules[name] = module
    return module
