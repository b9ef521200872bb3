"""Build the JIT-compiled operators a CPU run needs, once, at set-up (``make venv``): ds_odc's
memory-ordering operator and DeepSpeed's CPU shared-memory communication operator.

Both would otherwise be built by the first rank that needs them, inside a test or a training job,
where a rank killed mid-build (a timeout, a test of a killed peer) leaves a lock file that makes
every later build wait."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from ds_odc.ops_builder import ATOMICS, load_op  # noqa: E402

load_op(ATOMICS)
if os.environ["DS_ACCELERATOR"] == "cpu":
    from deepspeed.comm.torch import build_shm_op  # noqa: E402

    build_shm_op()
print("operators built")
