"""What a Hugging Face ``Trainer`` that asks for ODC does differently, bound on that Trainer only.

A Trainer asks for ODC when the ds_config of its arguments does (``args.hf_deepspeed_config.config``,
``"stage": "odc"``). Such a Trainer instance gets, as methods of its own (``types.MethodType``, each
delegating to its class's method; :func:`ds_odc.integration.patching.bind`):

* ``train``: first releases the inference-only ODC engine an earlier ``evaluate()`` left behind (below);
* ``log``: adds the ``ODC/...`` figures to each training log (:mod:`ds_odc.integration.hf_metrics`), so
  ``report_to`` shows them;
* with an odc balance block, the five methods of :mod:`ds_odc.integration.hf_balance`.

Every other Trainer, and the ``Trainer`` class itself, runs transformers' code. To reach an instance
at all, one class-level hook is needed (Python offers no other place where every new Trainer passes):
``Trainer.__init__`` is replaced by a pass-through that runs the original, then binds the instance if,
and only if, its config asks for ODC. Even that hook is installed only once the process has met an
odc config (:mod:`ds_odc.integration.hf`, when ``TrainingArguments`` reads one), and only after
``transformers.trainer`` is imported: a job that never uses ODC keeps ``Trainer`` exactly as it was. A
method the bound instance needs and its class lacks (another transformers release) fails when that
Trainer is built, naming the release and the method, never at import.

**evaluate() before train().** ``evaluate()`` before ``train()`` builds an inference-only DeepSpeed
engine (no optimizer) and keeps it as ``trainer.model_wrapped``. ``train()`` then sees an already
wrapped model, skips ``accelerator.prepare`` and never builds a training engine: its first backward
fails with ``'NoneType' object has no attribute 'backward'`` (transformers 5.23.0 / accelerate 1.15.0;
stage 3 fails the same way, and is left as it is). An ODC Trainer's ``train`` releases that engine
first: its ZeRO-3 module hooks are removed (``engine.destroy()``), the Trainer and the Accelerator forget
it, and training builds an ODC engine on the bare model as if ``evaluate()`` had not run. The
parameters stay partitioned throughout, so nothing is re-initialised.
"""
from __future__ import annotations

import functools

from deepspeed.utils import logger

from ds_odc.config import requested_options
from ds_odc.integration.hf_balance import bind_balance
from ds_odc.integration.hf_metrics import STATE_ATTRIBUTE as FIGURES_ATTRIBUTE
from ds_odc.integration.hf_metrics import TrainerFigures
from ds_odc.integration.patching import PatchSet, bind
from ds_odc.integration.versions import untested_hf_release
from ds_odc_import_hooks import when_imported

PATCHED_MODULE = "transformers.trainer"
_patches = PatchSet("transformers' Trainer binds ODC behaviour to the Trainers that ask for it")


# -- the engine evaluate() left behind ------------------------------------------------------------------
def _inference_only_odc_engine(engine) -> bool:
    from ds_odc.integration.engine import ODCEngine

    return isinstance(engine, ODCEngine) and not engine.odc_trains


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


def _train(original, trainer, *args, **kwargs):
    release_inference_engine(trainer)
    return original(trainer, *args, **kwargs)


# -- which Trainers ask for ODC -------------------------------------------------------------------------
def odc_options(trainer):
    """The :class:`~ds_odc.config.ODCConfig` of a Trainer whose ds_config asks for the odc stage, else None."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    config = getattr(getattr(trainer.args, "hf_deepspeed_config", None), "config", None)
    # canonical (stage 3 and the top-level marker) once accelerate has read it; as written otherwise: both
    # blocks read by the config's one reader, as canonicalize reads them
    return requested_options(config)


def bind_if_odc(trainer) -> bool:
    """Bind the ODC behaviour on ``trainer`` if its config asks for the odc stage; True if it does."""
    options = odc_options(trainer)
    if options is None:
        return False
    import transformers

    release = f"transformers {transformers.__version__}"
    if options.balance is not None:
        bind_balance(trainer, options.balance, release=release)
    if getattr(trainer, FIGURES_ATTRIBUTE, None) is None:
        figures = TrainerFigures()
        bind(trainer, {"log": figures.log}, needed_for="the odc stage's figures in the Trainer's logs", release=release)
        setattr(trainer, FIGURES_ATTRIBUTE, figures)
    bind(trainer, {"train": _train}, needed_for="the odc stage", release=release)
    return True


# -- the one class-level hook ----------------------------------------------------------------------------
def _binding(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        bind_if_odc(self)

    return __init__


def _install(module) -> None:
    trainer_class = getattr(module, "Trainer", None)
    if not isinstance(trainer_class, type):
        return  # no Trainer in this release: no Trainer to bind, and nothing else to do
    warning = untested_hf_release("transformers", __import__("transformers").__version__)
    if warning:
        logger.warning(warning)
    _patches.replace(trainer_class, "__init__", _binding, wraps=False)


def is_patched() -> bool:
    return _patches.active


def register() -> None:
    """Install the ``Trainer.__init__`` hook now if transformers' Trainer is imported, else right after it
    is (idempotent). Called the first time a config asks for the odc stage (:mod:`ds_odc.integration.hf`)."""
    when_imported(PATCHED_MODULE, _install)
