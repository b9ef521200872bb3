"""The DeepSpeed version whose private names ds_odc relies on, checked once at registration."""
import deepspeed

SUPPORTED_DEEPSPEED = "0.19.8"


def check_deepspeed_version() -> None:
    found = deepspeed.__version__.split("+")[0]
    if found != SUPPORTED_DEEPSPEED:
        raise ImportError(
            f"ds_odc {__import__('ds_odc').__version__} needs deepspeed=={SUPPORTED_DEEPSPEED} "
            f"(it hooks into ZeRO-3 internals of that release), found {deepspeed.__version__}")


#: transformers / accelerate releases whose DeepSpeed glue ``ds_odc.integration.hf`` was verified against.
#: Other releases get a warning (the patched method is checked structurally either way).
TESTED_HF = {"transformers": "5.23.0", "accelerate": "1.15.0"}


def untested_hf_release(package: str, version: str) -> str | None:
    """A warning text when ``package`` is not the release ds_odc was tested with, else None."""
    tested = TESTED_HF[package]
    if version.split("+")[0] == tested:
        return None
    return (f"ds_odc was tested with {package}=={tested}, found {version}; the 'odc' stage patches "
            f"{package}'s DeepSpeed glue (see ds_odc/integration/hf.py), install the tested release if it misbehaves")
