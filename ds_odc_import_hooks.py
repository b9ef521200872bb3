"""What ``ds_odc_autoload`` and ds_odc share, standard library only: post-import hooks (run a callback
once a module has finished importing), reading ``ACCELERATE_DEEPSPEED_ZERO_STAGE=odc``, and whether a
ds_config asks for the odc stage (:func:`asks_for_odc`).

Why a top-level module of its own: ``ds_odc_autoload`` runs at the start of every interpreter of the
environment and must not import ds_odc (seconds), while ds_odc itself patches transformers and
accelerate lazily, only once a program imports them, and translates the accelerate variable again when
it registers (autoload may be off). Both need these; neither may import the other for them
(ds_odc_autoload imports ds_odc when deepspeed is imported: a loop otherwise).
"""
from __future__ import annotations

import os
import sys
import warnings

#: What turns ds_odc's import-time activation off (named in the warning a failed hook raises).
OFF_SWITCH = "DS_ODC_AUTOLOAD"
#: Where accelerate reads the ZeRO stage from the environment (and axolotl exports the stage it is given).
ACCELERATE_STAGE = "ACCELERATE_DEEPSPEED_ZERO_STAGE"
#: ds_odc's environment switch (``ds_odc.config.ENV_SWITCH``): ``DS_ODC_STAGE3=odc`` makes every stage-3
#: config ask for the odc stage.
STAGE3_SWITCH = "DS_ODC_STAGE3"
#: Values that leave the switch off.
SWITCH_OFF = ("", "0", "off", "false", "no")
#: The stage value and the options block that ask for ODC (``ds_odc.config.ODC_STAGE`` and ``MARKER_KEY``).
ODC = "odc"


def is_odc_stage(value) -> bool:
    """Whether a ZeRO stage value names the odc stage: "odc" in any case, blanks around it ignored. The one
    comparison for every place a stage meets "odc" (``zero_optimization.stage``, ``DS_ODC_STAGE3``,
    ``ACCELERATE_DEEPSPEED_ZERO_STAGE``), so the config and the environment accept the same spellings.

    >>> is_odc_stage("odc"), is_odc_stage(" ODC "), is_odc_stage(3), is_odc_stage("odc3")
    (True, True, False, False)
    """
    return isinstance(value, str) and value.strip().lower() == ODC


def asks_for_odc(config, environ=os.environ) -> bool:
    """Whether a ds_config asks for the odc stage, as :func:`ds_odc.config.canonicalize` reads it: ``"stage":
    "odc"``, an ``"odc"`` block (under ``zero_optimization``: the marker form; at the top level: the canonical
    form), or stage 3 while ``DS_ODC_STAGE3`` is on. The one answer for the autoload's guard (which must not
    import ds_odc to ask) and for ds_odc's accelerate patch; ``tests/unit/test_autoload_hooks.py`` holds it to
    ``canonicalize``. A switch set to anything but "odc" or an off value counts as on: such a config goes to
    ds_odc, which refuses the value by name.

    >>> marker, plain = {"zero_optimization": {"stage": 3, "odc": {}}}, {"zero_optimization": {"stage": 3}}
    >>> asks_for_odc(marker), asks_for_odc(plain, environ={}), asks_for_odc(plain, environ={"DS_ODC_STAGE3": "odc"})
    (True, False, True)
    """
    if not isinstance(config, dict):
        return False
    zero = config.get("zero_optimization")
    zero = zero if isinstance(zero, dict) else {}
    if is_odc_stage(zero.get("stage")) or ODC in config or ODC in zero:
        return True
    return zero.get("stage") in (3, "3") and environ.get(STAGE3_SWITCH, "").strip().lower() not in SWITCH_OFF


def translate_accelerate_stage(environ=os.environ) -> None:
    """``ACCELERATE_DEEPSPEED_ZERO_STAGE=odc`` (what axolotl exports for the stage it was given; accelerate
    calls ``int()`` on it; any spelling :func:`is_odc_stage` accepts) becomes stage 3 plus ds_odc's environment
    switch ``DS_ODC_STAGE3=odc``, for this process and the processes it starts. Any other value is left alone."""
    if is_odc_stage(environ.get(ACCELERATE_STAGE)):
        environ[ACCELERATE_STAGE] = "3"
        environ.setdefault(STAGE3_SWITCH, ODC)

#: module name -> callbacks still waiting for that module to finish importing.
_waiting: dict = {}


def _run_callbacks(name: str, module) -> None:
    for callback in _waiting.pop(name, ()):
        try:
            callback(module)
        except Exception as err:  # noqa: BLE001 - never break the user's own import
            warnings.warn(f"ds_odc: post-import hook {getattr(callback, '__qualname__', callback)!r} for "
                          f"{name!r} failed: {type(err).__name__}: {err} (set {OFF_SWITCH}=0 to skip autoloading)",
                          RuntimeWarning, stacklevel=2)


class _HookedLoader:
    """Runs the real loader, then the callbacks waiting for the module. Everything else is delegated."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        # Hand the module its real loader back first: code that inspects ``__loader__`` /
        # ``__spec__.loader`` (resources, pkgutil) sees exactly what it would without us.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _run_callbacks(self._name, module)

    def __getattr__(self, attr):
        return getattr(self._loader, attr)


class _PostImportFinder:
    """A ``sys.meta_path`` entry that finds nothing itself: for a watched name it asks the finders
    after it for the real spec and wraps that spec's loader in :class:`_HookedLoader`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _waiting:
            return None
        finders = sys.meta_path
        start = finders.index(self) + 1 if self in finders else 0
        for finder in finders[start:]:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


_finder = _PostImportFinder()


def when_imported(name: str, callback) -> None:
    """Call ``callback(module)`` once module ``name`` has finished importing (now, if it already has).

    A callback that raises does not break the import; it is reported as a ``RuntimeWarning``.
    Registering the same callback twice for a name is a no-op."""
    callbacks = _waiting.setdefault(name, [])
    if callback not in callbacks:
        callbacks.append(callback)
    module = sys.modules.get(name)
    if module is not None:
        _run_callbacks(name, module)
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
