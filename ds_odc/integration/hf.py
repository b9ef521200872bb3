"""transformers and accelerate see ``"stage": "odc"`` as ZeRO-3.

Both libraries read the ZeRO stage from their own copy of the ds_config, through accelerate's
``HfDeepSpeedConfig.set_stage_and_offload`` (transformers' ``HfDeepSpeedConfig`` and
``HfTrainerDeepSpeedConfig`` subclass it; accelerate's ``DeepSpeedPlugin`` re-reads the stage
from it). Left alone, "odc" makes ``is_zero3()`` False: no ``zero.Init`` in ``from_pretrained``,
``evaluate()`` before ``train()`` refused, ``save_model`` writing empty partitioned tensors, and
``accelerator.no_sync`` comparing ``"odc" < 2`` (TypeError).

One patch fixes all of these at their source: for a config that mentions odc (``"stage": "odc"`` or
an ``"odc"`` block), ``set_stage_and_offload`` first canonicalises it *in place* (stage 3 plus the
top-level "odc" marker, see :func:`ds_odc.config.canonicalize`), then runs unchanged. Every later reader
(``is_deepspeed_zero3_enabled``, the plugin's ``zero_stage``, ``Accelerator._prepare_deepspeed``, which
hands the same dict to ``deepspeed.initialize``) sees stage 3, and the marker still selects the ODC
engine. Any other config goes straight to accelerate's own method.

The first odc config seen is also the moment a job asks for ODC: only then is the Trainer hook
(:mod:`ds_odc.integration.hf_trainer`) installed, and only then does an untested accelerate release
get its warning. A job that never uses ODC meets no other change in transformers or accelerate.

Applied lazily: only once ``accelerate.utils.deepspeed`` is imported (see
:func:`ds_odc_import_hooks.when_imported`), so ``import ds_odc`` does not import accelerate.
"""
from __future__ import annotations

import functools

from deepspeed.utils import logger

from ds_odc.config import canonicalize, is_odc_config
from ds_odc.integration import hf_trainer
from ds_odc.integration.patching import PatchSet
from ds_odc.integration.versions import untested_hf_release
from ds_odc_import_hooks import asks_for_odc, when_imported

PATCHED_MODULE = "accelerate.utils.deepspeed"
_patches = PatchSet("accelerate reads an 'odc' ds_config as ZeRO-3")


@functools.cache
def _odc_asked() -> None:
    """Once per process, the first time a config asks for the odc stage."""
    import accelerate

    warning = untested_hf_release("accelerate", accelerate.__version__)
    if warning:
        logger.warning(warning)
    hf_trainer.register()


def read_as_accelerate(config) -> None:
    """What accelerate's ``set_stage_and_offload`` does first (and ``ds_odc_autoload``'s guard, the call
    that imports ds_odc): canonicalise a config that asks for odc in place (refusing, by name, one that asks
    wrongly); leave any other alone."""
    if asks_for_odc(config):
        canonicalize(config)  # idempotent; also refuses odc options next to another stage, naming why
        if is_odc_config(config):
            _odc_asked()


def _canonicalising(original):
    @functools.wraps(original)
    def set_stage_and_offload(self):
        read_as_accelerate(getattr(self, "config", None))
        return original(self)

    return set_stage_and_offload


def _install(module) -> None:
    cls = getattr(module, "HfDeepSpeedConfig", None)
    if not callable(getattr(cls, "set_stage_and_offload", None)):
        raise ImportError(f"{PATCHED_MODULE}.HfDeepSpeedConfig.set_stage_and_offload not found: this accelerate "
                          "release cannot be patched for the 'odc' stage")
    # unwrap ds_odc_autoload's import guard (undo() puts the guard back)
    _patches.replace(cls, "set_stage_and_offload",
                     lambda current: _canonicalising(getattr(current, "ds_odc_guarded", current)), wraps=False)


def is_patched() -> bool:
    return _patches.active


def register() -> None:
    """Patch accelerate's ``HfDeepSpeedConfig`` now if imported, else right after it is (idempotent)."""
    when_imported(PATCHED_MODULE, _install)
