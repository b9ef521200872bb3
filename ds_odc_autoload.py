"""Zero-code-change activation of ds_odc, run at interpreter start by ``ds_odc_autoload.pth``.

Why a separate top-level module: a ``.pth`` line runs in *every* Python process of the
environment, so it must be cheap. Importing ``ds_odc`` imports DeepSpeed and torch (seconds);
this module imports nothing beyond the standard library and only installs post-import hooks:

* when ``deepspeed`` has finished importing, ``import ds_odc`` (registers the "odc" stage);
* when ``accelerate.utils.deepspeed`` has finished importing (accelerate imports it whenever
  DeepSpeed is *installed*, without importing DeepSpeed itself), ``HfDeepSpeedConfig`` learns to
  import ds_odc the first time it is handed a config that asks for the "odc" stage. That is the
  moment ``TrainingArguments(deepspeed=...)`` reads the stage, often before ``deepspeed`` is
  imported; from then on ds_odc's own patch (``ds_odc.integration.hf``) is in place.

``DS_ODC_AUTOLOAD=0`` (or ``false``/``no``/``off``) turns all of it off; scripts then need an
explicit ``import ds_odc``.

:func:`when_imported` is also what ``ds_odc.integration`` uses to patch transformers and
accelerate lazily, only once a program imports them.
"""
from __future__ import annotations

import os
import sys
import warnings

ENV_VAR = "DS_ODC_AUTOLOAD"
_OFF_VALUES = ("0", "false", "no", "off")

#: module name -> callbacks still waiting for that module to finish importing.
_waiting: dict = {}


def enabled() -> bool:
    """False when the environment variable ``DS_ODC_AUTOLOAD`` turns autoloading off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF_VALUES


def _run_callbacks(name: str, module) -> None:
    for callback in _waiting.pop(name, ()):
        try:
            callback(module)
        except Exception as err:  # noqa: BLE001 - never break the user's own import
            warnings.warn(f"ds_odc: post-import hook {getattr(callback, '__qualname__', callback)!r} for "
                          f"{name!r} failed: {type(err).__name__}: {err} (set {ENV_VAR}=0 to skip autoloading)",
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


def _import_ds_odc(_module=None) -> None:
    import ds_odc  # noqa: F401  registers the "odc" stage (a no-op while ds_odc itself is importing)


def _asks_for_odc(config) -> bool:
    if not isinstance(config, dict):
        return False
    zero = config.get("zero_optimization")
    return (isinstance(zero, dict) and zero.get("stage") == "odc") or "odc" in config


def _guard_hf_deepspeed_config(module) -> None:
    """Make ``HfDeepSpeedConfig`` import ds_odc when it meets an "odc" config (cheap otherwise)."""
    if "ds_odc" in sys.modules:
        return  # ds_odc's own patch is (or is being) installed
    cls = module.HfDeepSpeedConfig
    original = cls.set_stage_and_offload
    if hasattr(original, "ds_odc_guarded"):
        return

    def set_stage_and_offload(self):
        if _asks_for_odc(getattr(self, "config", None)):
            _import_ds_odc()  # installs ds_odc.integration.hf's patch in place of this guard
        current = cls.__dict__["set_stage_and_offload"]
        return current(self) if current is not set_stage_and_offload else original(self)

    set_stage_and_offload.ds_odc_guarded = original  # what ds_odc's own patch wraps instead of this guard
    cls.set_stage_and_offload = set_stage_and_offload


def install() -> None:
    """The ``.pth`` entry point: install the hooks unless ``DS_ODC_AUTOLOAD`` turns them off."""
    if not enabled():
        return
    # Idempotent (when_imported ignores a callback registered twice): site may process a .pth file
    # twice, e.g. in a venv made from a pyenv Python.
    when_imported("deepspeed", _import_ds_odc)
    when_imported("accelerate.utils.deepspeed", _guard_hf_deepspeed_config)
