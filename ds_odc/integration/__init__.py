"""The only package that touches DeepSpeed internals. See each module's docstring for its patch."""
from ds_odc.integration.versions import check_deepspeed_version


def register() -> None:
    """Make ``deepspeed.initialize`` understand ``"stage": "odc"`` (idempotent)."""
    check_deepspeed_version()
    from ds_odc.integration.initialize import register as _register

    _register()
