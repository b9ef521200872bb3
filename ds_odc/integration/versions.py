"""The DeepSpeed version whose private names ds_odc relies on, checked once at registration."""
import deepspeed

SUPPORTED_DEEPSPEED = "0.19.8"


def check_deepspeed_version() -> None:
    found = deepspeed.__version__.split("+")[0]
    if found != SUPPORTED_DEEPSPEED:
        raise ImportError(
            f"ds_odc {__import__('ds_odc').__version__} needs deepspeed=={SUPPORTED_DEEPSPEED} "
            f"(it hooks into ZeRO-3 internals of that release), found {deepspeed.__version__}")
