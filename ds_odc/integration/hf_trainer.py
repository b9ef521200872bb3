"""``Trainer.train()`` after ``Trainer.evaluate()`` on an "odc" config.

``evaluate()`` before ``train()`` builds an inference-only DeepSpeed engine (no optimizer) and keeps
it as ``trainer.model_wrapped``. ``train()`` then sees an already wrapped model, skips
``accelerator.prepare`` and never builds a training engine: its first backward fails with
``'NoneType' object has no attribute 'backward'`` (transformers 5.23.0 / accelerate 1.15.0; stage 3
fails the same way, and is left as it is).

For an ODC inference engine the patch releases it at the start of training: its ZeRO-3 module hooks
are removed (``engine.destroy()``), the Trainer and the Accelerator forget it, and training builds an
ODC engine on the bare model as if ``evaluate()`` had not run. The parameters stay partitioned
throughout, so nothing is re-initialised. Patched name: ``transformers.trainer.deepspeed_init`` (the
Trainer's own reference to ``transformers.integrations.deepspeed.deepspeed_init``).
"""
from __future__ import annotations

import functools

from deepspeed.utils import logger
from ds_odc_import_hooks import when_imported

from ds_odc.integration.versions import untested_hf_release

PATCHED_MODULE = "transformers.trainer"
_originals: dict = {}


def _inference_only_odc_engine(engine) -> bool:
    from ds_odc.engine import ODCEngine
    from ds_odc.integration.zero3_optimizer import ODCStage3Optimizer

    return isinstance(engine, ODCEngine) and not isinstance(engine.optimizer, ODCStage3Optimizer)


def release_inference_engine(trainer) -> bool:
    """Forget the inference-only ODC engine ``evaluate()`` left behind; True if there was one."""
    engine = getattr(trainer, "deepspeed", None)
    if engine is None or not _inference_only_odc_engine(engine):
        return False
    engine.destroy()
    accelerator = trainer.accelerator
    accelerator._models = [model for model in accelerator._models if model is not engine]
    wrapped = accelerator.deepspeed_engine_wrapped
    if wrapped is not None and getattr(wrapped, "engine", None) is engine:
        accelerator.deepspeed_engine_wrapped = None
    trainer.model_wrapped = trainer.model
    trainer.deepspeed = None
    return True


def _deepspeed_init(original, trainer, num_training_steps, inference=False):
    if not inference:
        release_inference_engine(trainer)
    return original(trainer, num_training_steps, inference=inference)


def _patch(module) -> None:
    if _originals:
        return
    current = getattr(module, "deepspeed_init", None)
    if current is None:
        raise ImportError(f"{PATCHED_MODULE}.deepspeed_init not found: this transformers release cannot be "
                          "patched for evaluate() before train() on the 'odc' stage")
    import transformers

    warning = untested_hf_release("transformers", transformers.__version__)
    if warning:
        logger.warning(warning)
    _originals["deepspeed_init"] = current
    module.deepspeed_init = functools.wraps(current)(functools.partial(_deepspeed_init, current))


def register() -> None:
    """Patch the Trainer module now if imported, else right after it is (idempotent)."""
    if not _originals:
        when_imported(PATCHED_MODULE, _patch)
