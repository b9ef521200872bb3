"""The DeepSpeed launcher carries ds_odc's environment switch to every node.

``DS_ODC_STAGE3=odc`` (and ``DS_ODC_OPTIONS``) must reach every rank: ranks that disagree are refused at
``initialize`` (:mod:`ds_odc.integration.initialize`). torchrun hands its environment to the ranks of its
node, and each node's launcher gets the user's. The DeepSpeed launcher starting other nodes over
pdsh/ssh exports only variables whose names start with one of ``deepspeed.launcher.runner.EXPORT_ENVS``
(and those of a ``.deepspeed_env`` file): ``DS_ODC_`` is added to that list once the launcher's module is
imported (the ``deepspeed`` command imports deepspeed first, which imports ds_odc through its autoload).
"""
from __future__ import annotations

from ds_odc_import_hooks import when_imported

PATCHED_MODULE = "deepspeed.launcher.runner"
EXPORTED_PREFIX = "DS_ODC_"


def _export_ds_odc_variables(module) -> None:
    exports = getattr(module, "EXPORT_ENVS", None)
    if isinstance(exports, list) and EXPORTED_PREFIX not in exports:
        exports.append(EXPORTED_PREFIX)


def register() -> None:
    when_imported(PATCHED_MODULE, _export_ds_odc_variables)
