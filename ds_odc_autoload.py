"""Zero-code-change activation of ds_odc, run at interpreter start by ``ds_odc_autoload.pth``.

Why a separate top-level module: a ``.pth`` line runs in *every* Python process of the
environment, so it must be cheap. Importing ``ds_odc`` imports DeepSpeed and torch (seconds);
this module imports nothing beyond the standard library and only installs post-import hooks:

* when ``deepspeed`` has finished importing, ``import ds_odc`` (registers the "odc" stage);
* ``ACCELERATE_DEEPSPEED_ZERO_STAGE=odc`` (axolotl exports the stage it is given there, and accelerate
  calls ``int()`` on it) is read as stage 3 with ``DS_ODC_STAGE3=odc``;
* when ``accelerate.utils.deepspeed`` has finished importing (accelerate imports it whenever
  DeepSpeed is *installed*, without importing DeepSpeed itself), ``HfDeepSpeedConfig`` learns to
  import ds_odc the first time it is handed a config that asks for the "odc" stage. That is the
  moment ``TrainingArguments(deepspeed=...)`` reads the stage, often before ``deepspeed`` is
  imported; from then on ds_odc's own patch (``ds_odc.integration.hf``) is in place.

``DS_ODC_AUTOLOAD=0`` (or ``false``/``no``/``off``) turns all of it off; scripts then need an
explicit ``import ds_odc``.

The hooks themselves live in ``ds_odc_import_hooks`` (standard library only), which ``ds_odc.integration``
also uses to patch transformers and accelerate lazily, only once a program imports them.
"""
from __future__ import annotations

import os
import sys

from ds_odc_import_hooks import ACCELERATE_STAGE, OFF_SWITCH, asks_for_odc, translate_accelerate_stage, when_imported

ENV_VAR = OFF_SWITCH
_OFF_VALUES = ("0", "false", "no", "off")
__all__ = ["ACCELERATE_STAGE", "ENV_VAR", "enabled", "install", "translate_accelerate_stage"]


def enabled() -> bool:
    """False when the environment variable ``DS_ODC_AUTOLOAD`` turns autoloading off."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in _OFF_VALUES


def _import_ds_odc(_module=None) -> None:
    import ds_odc  # noqa: F401  registers the "odc" stage (a no-op while ds_odc itself is importing)


def _guard_hf_deepspeed_config(module) -> None:
    """Make ``HfDeepSpeedConfig`` import ds_odc when it meets an "odc" config (cheap otherwise)."""
    if "ds_odc" in sys.modules:
        return  # ds_odc's own patch is (or is being) installed
    cls = getattr(module, "HfDeepSpeedConfig", None)
    original = getattr(cls, "set_stage_and_offload", None)
    if original is None or hasattr(original, "ds_odc_guarded"):
        return  # another accelerate release: nothing to guard (ds_odc's own patch says what is missing)

    def set_stage_and_offload(self):
        config = getattr(self, "config", None)
        if asks_for_odc(config):
            _import_ds_odc()  # installs ds_odc.integration.hf's patch in place of this guard, for later calls
            from ds_odc.integration.hf import read_as_accelerate

            read_as_accelerate(config)  # what that patch does first, for this call
        return original(self)

    set_stage_and_offload.ds_odc_guarded = original  # what ds_odc's own patch wraps instead of this guard
    cls.set_stage_and_offload = set_stage_and_offload


def install() -> None:
    """The ``.pth`` entry point: install the hooks unless ``DS_ODC_AUTOLOAD`` turns them off."""
    if not enabled():
        return
    translate_accelerate_stage()
    # Idempotent (when_imported ignores a callback registered twice): site may process a .pth file
    # twice, e.g. in a venv made from a pyenv Python.
    when_imported("deepspeed", _import_ds_odc)
    when_imported("accelerate.utils.deepspeed", _guard_hf_deepspeed_config)
