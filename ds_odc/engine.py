"""``ODCEngine``, the engine ``deepspeed.initialize`` returns for ``"stage": "odc"``.

The class lives with the rest of the DeepSpeed adapter (:mod:`ds_odc.integration.engine`), the one package
that touches DeepSpeed's private names; this module is its public address."""
from ds_odc.integration.engine import ODCEngine

__all__ = ["ODCEngine"]
