"""Build the JIT-compiled operators a CPU run needs, once, at set-up (``make venv``): ds_odc's
memory-ordering operator, DeepSpeed's CPU shared-memory communication operator, and DeepSpeed's CPU
Adam and Fused Adam (``offload_optimizer``, and FusedAdam on CPU ranks: about six minutes on two cores).

Each would otherwise be built by the first rank that needs it, inside a test or a training job, where a
rank killed mid-build (a timeout, a test of a killed peer) leaves torch's lock file behind, and every
later build of that operator waits on it with no bound (ds_odc breaks that lock for its own operators,
``ds_odc/ops_builder.py``; DeepSpeed's are DeepSpeed's). Built here, a test that runs alone in a fresh
checkout costs what it costs in the suite."""
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from ds_odc.ops_builder import ATOMICS, load_op  # noqa: E402

load_op(ATOMICS)
if os.environ["DS_ACCELERATOR"] == "cpu":
    from deepspeed.accelerator import get_accelerator  # noqa: E402
    from deepspeed.comm.torch import build_shm_op  # noqa: E402

    build_shm_op()
    for builder in ("CPUAdamBuilder", "FusedAdamBuilder"):
        get_accelerator().create_op_builder(builder).load(verbose=False)
print("operators built")
