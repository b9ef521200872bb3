"""ds_odc: DeepSpeed ZeRO-3 on on-demand, one-sided communication.

``import ds_odc`` registers the ``"stage": "odc"`` value of ``zero_optimization``; after that,
``deepspeed.initialize`` returns an :class:`ODCEngine` for such a config.
"""
__version__ = "0.1.0"

from ds_odc.config import ODCConfig, canonicalize  # noqa: E402
from ds_odc.errors import ODCConfigError, ODCError, ODCPeerError, ODCTimeoutError  # noqa: E402
from ds_odc.integration import register  # noqa: E402

register()

from ds_odc.integration import clean_exit  # noqa: E402

clean_exit.install()  # gloo workers finish before Python finalizes (see clean_exit.py)

from ds_odc.engine import ODCEngine  # noqa: E402
from ds_odc.runtime import LossNormalization, Phase  # noqa: E402

__all__ = ["ODCConfig", "ODCEngine", "ODCError", "ODCConfigError", "ODCPeerError", "ODCTimeoutError",
           "LossNormalization", "Phase", "canonicalize", "register", "__version__"]
