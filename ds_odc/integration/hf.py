"""transformers and accelerate see ``"stage": "odc"`` as ZeRO-3.

Both libraries read the ZeRO stage from their own copy of the ds_config, through accelerate's
``HfDeepSpeedConfig.set_stage_and_offload`` (transformers' ``HfDeepSpeedConfig`` and
``HfTrainerDeepSpeedConfig`` subclass it; accelerate's ``DeepSpeedPlugin`` re-reads the stage
from it). Left alone, "odc" makes ``is_zero3()`` False: no ``zero.Init`` in ``from_pretrained``,
``evaluate()`` before ``train()`` refused, ``save_model`` writing empty partitioned tensors, and
``accelerator.no_sync`` comparing ``"odc" < 2`` (TypeError).

One patch fixes all of these at their source: ``set_stage_and_offload`` first canonicalises its
config *in place* (stage 3 plus the top-level "odc" marker, see :func:`ds_odc.config.canonicalize`),
then runs unchanged. Every later reader (``is_deepspeed_zero3_enabled``, the plugin's
``zero_stage``, ``Accelerator._prepare_deepspeed``, which hands the same dict to
``deepspeed.initialize``) sees stage 3, and the marker still selects the ODC engine.

Applied lazily: only once ``accelerate.utils.deepspeed`` is imported (see
:func:`ds_odc_autoload.when_imported`), so ``import ds_odc`` does not import accelerate.
"""
from __future__ import annotations

import functools

from deepspeed.utils import logger
from ds_odc_import_hooks import when_imported

from ds_odc.config import canonicalize
from ds_odc.integration.versions import untested_hf_release

PATCHED_MODULE = "accelerate.utils.deepspeed"
_originals: dict = {}


def _canonicalising(original):
    @functools.wraps(original)
    def set_stage_and_offload(self):
        config = getattr(self, "config", None)
        if isinstance(config, dict):
            canonicalize(config)  # also refuses odc options next to another stage, naming why
        return original(self)

    return set_stage_and_offload


def _patch(module) -> None:
    if _originals:
        return
    cls = getattr(module, "HfDeepSpeedConfig", None)
    current = getattr(cls, "set_stage_and_offload", None) if cls is not None else None
    if current is None:
        raise ImportError(f"{PATCHED_MODULE}.HfDeepSpeedConfig.set_stage_and_offload not found: this accelerate "
                          "release cannot be patched for the 'odc' stage")
    import accelerate

    warning = untested_hf_release("accelerate", accelerate.__version__)
    if warning:
        logger.warning(warning)
    original = getattr(current, "ds_odc_guarded", current)  # unwrap ds_odc_autoload's import guard
    _originals["set_stage_and_offload"] = current
    cls.set_stage_and_offload = _canonicalising(original)


def is_patched() -> bool:
    return bool(_originals)


def register() -> None:
    """Patch accelerate's ``HfDeepSpeedConfig`` now if imported, else right after it is (idempotent)."""
    if not _originals:
        when_imported(PATCHED_MODULE, _patch)
