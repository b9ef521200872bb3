"""The only package that touches DeepSpeed internals. See each module's docstring for its patch."""
from ds_odc.integration.surface import assert_surface
from ds_odc.integration.versions import check_deepspeed_version
from ds_odc_import_hooks import when_imported

#: The DeepSpeed launcher carries ds_odc's environment switch to every node (:func:`_export_ds_odc_variables`).
LAUNCHER_MODULE = "deepspeed.launcher.runner"
EXPORTED_PREFIX = "DS_ODC_"


def register() -> None:
    """Make ``deepspeed.initialize`` understand ``"stage": "odc"`` (idempotent), and transformers /
    accelerate see it as ZeRO-3 once they are imported (the Trainer hook follows once a config asks for
    the odc stage: :mod:`ds_odc.integration.hf`).

    First checks every private DeepSpeed and torch name ds_odc relies on (:mod:`ds_odc.integration.surface`;
    not the transformers / accelerate ones, so that importing ds_odc does not import them), then the
    DeepSpeed release: on another release, the error names what is missing, if anything is."""
    assert_surface()
    check_deepspeed_version()
    from ds_odc.integration import hf
    from ds_odc.integration.initialize import register as _register
    from ds_odc_import_hooks import translate_accelerate_stage

    translate_accelerate_stage()  # also done at interpreter start by ds_odc_autoload, unless autoload is off
    _register()
    hf.register()
    when_imported(LAUNCHER_MODULE, _export_ds_odc_variables)


def _export_ds_odc_variables(module) -> None:
    """The DeepSpeed launcher carries ds_odc's environment switch to every node.

    ``DS_ODC_STAGE3=odc`` (and ``DS_ODC_OPTIONS``) must reach every rank: ranks that disagree are refused at
    ``initialize`` (:mod:`ds_odc.integration.initialize`). torchrun hands its environment to the ranks of its
    node, and each node's launcher gets the user's. The DeepSpeed launcher starting other nodes over
    pdsh/ssh exports only variables whose names start with one of ``deepspeed.launcher.runner.EXPORT_ENVS``
    (and those of a ``.deepspeed_env`` file): ``DS_ODC_`` is added to that list once the launcher's module is
    imported (the ``deepspeed`` command imports deepspeed first, which imports ds_odc through its autoload)."""
    exports = getattr(module, "EXPORT_ENVS", None)
    if isinstance(exports, list) and EXPORTED_PREFIX not in exports:
        exports.append(EXPORTED_PREFIX)
