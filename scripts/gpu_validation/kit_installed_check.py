"""pytest plugin of the validation kit (``-p kit_installed_check``, copied beside the tests it runs): the
session stops at once, naming both places, if ``ds_odc`` would not come from the installed wheel in
``$ODC_KIT_SITE`` (the kit's items once imported the checkout's copy). Found, not imported: the
check must not pick DeepSpeed's accelerator in the pytest process."""
import importlib.util
import os

import pytest


def pytest_configure(config):
    site = os.environ.get("ODC_KIT_SITE")
    if not site:
        return
    spec = importlib.util.find_spec("ds_odc")
    where = os.path.realpath(spec.origin) if spec and spec.origin else "nowhere"
    if not where.startswith(os.path.realpath(site) + os.sep):
        raise pytest.UsageError(f"ds_odc would be imported from {where}, not from the installed wheel in {site}")
    config.stash[_KEY] = where


_KEY = pytest.StashKey[str]()


def pytest_report_header(config):
    where = config.stash.get(_KEY, None)
    return f"ds_odc from {where} (the installed wheel)" if where else None
