"""The releases ds_odc supports: a range of DeepSpeed releases (any other is refused at registration), and the
transformers / accelerate releases its Hugging Face glue was verified on (any other gets a warning).

The same ranges are declared in ``pyproject.toml`` (``dependencies`` and the ``hf`` extra), so pip will not put
ds_odc beside a release outside them; ``tests/unit/test_hf_versions.py`` keeps the two in step. Where a private
DeepSpeed name differs inside the range, the difference is a per-release entry of
:mod:`ds_odc.integration.surface_table` (``Change``), checked at import like every other entry.
``tests/compat/run_version_matrix.py`` runs the suite's parity, uneven-count, checkpoint, frozen-engine, HF
Trainer and split-policy tests against each end and each changed release, and on a torch axis (the torch releases
run, ``offload_states`` tests included; docs/frameworks.md has its tables). torch is declared from 2.11, the oldest
release run; it is not checked here (pip holds the floor).
"""
from __future__ import annotations

from packaging.version import Version

#: The first and the last DeepSpeed release supported (both included).
DEEPSPEED_RANGE = ("0.18.0", "0.19.8")

#: transformers / accelerate: the oldest and the newest minor release ``ds_odc.integration.hf*`` was verified on
#: (every patch release of both included). Other releases get a warning: the patched methods are checked
#: structurally either way (``check_surface(include_hf=True)``).
TESTED_HF = {"transformers": ("4.57", "5.23"), "accelerate": ("1.11", "1.15")}


def supported_deepspeed() -> str:
    """The range as a pip specifier, e.g. ``>=0.18.0,<=0.19.8``."""
    return f">={DEEPSPEED_RANGE[0]},<={DEEPSPEED_RANGE[1]}"


def release(version: str) -> Version:
    """``0.19.8+cu130`` and ``0.19.8`` are the same release; so are ``5.23.0.dev0`` and ``5.23.0``."""
    return Version(Version(version.split("+")[0]).base_version)


def deepspeed_in_range(version: str) -> bool:
    low, high = DEEPSPEED_RANGE
    return Version(low) <= release(version) <= Version(high)


def check_deepspeed_version(version: str | None = None) -> None:
    """Raise ImportError when the installed DeepSpeed (or ``version``) is outside :data:`DEEPSPEED_RANGE`."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if not deepspeed_in_range(version):
        raise ImportError(
            f"ds_odc {__import__('ds_odc').__version__} needs deepspeed{supported_deepspeed()} (it hooks into ZeRO-3 "
            f"internals of those releases, listed per release in ds_odc/integration/surface_table.py), found "
            f"{version}")


def hf_in_range(package: str, version: str) -> bool:
    """Whether ``version`` of transformers / accelerate is within the tested minor releases."""
    low, high = TESTED_HF[package]
    minor = release(version).release[:2]
    return Version(low).release[:2] <= minor <= Version(high).release[:2]


def tested_hf(package: str) -> str:
    """``4.57 to 5.23`` (every patch release of both ends included)."""
    low, high = TESTED_HF[package]
    return f"{low}.x to {high}.x"


def untested_hf_release(package: str, version: str) -> str | None:
    """A warning text when ``package`` is outside the tested releases, else None."""
    if hf_in_range(package, version):
        return None
    return (f"ds_odc was tested with {package} {tested_hf(package)}, found {version}; the 'odc' stage patches "
            f"{package}'s DeepSpeed glue (see ds_odc/integration/hf.py), install a tested release if it misbehaves")
