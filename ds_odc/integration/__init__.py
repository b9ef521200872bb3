"""The only package that touches DeepSpeed internals. See each module's docstring for its patch."""
from ds_odc.integration.surface import assert_surface
from ds_odc.integration.versions import check_deepspeed_version


def register() -> None:
    """Make ``deepspeed.initialize`` understand ``"stage": "odc"`` (idempotent), and transformers /
    accelerate see it as ZeRO-3 once they are imported (the Trainer hook follows once a config asks for
    the odc stage: :mod:`ds_odc.integration.hf`).

    First checks every private DeepSpeed and torch name ds_odc relies on (:mod:`ds_odc.integration.surface`;
    not the transformers / accelerate ones, so that importing ds_odc does not import them), then the
    DeepSpeed release: on another release, the error names what is missing, if anything is."""
    assert_surface()
    check_deepspeed_version()
    from ds_odc.integration import hf, launcher
    from ds_odc.integration.initialize import register as _register
    from ds_odc_import_hooks import translate_accelerate_stage

    translate_accelerate_stage()  # also done at interpreter start by ds_odc_autoload, unless autoload is off
    _register()
    hf.register()
    launcher.register()
