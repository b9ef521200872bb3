"""Imported last by the harness's forkserver (``harness.PRELOAD``): what every rank would otherwise do again on its
own after the fork. DeepSpeed probes which of its operators this machine can build (compiler subprocesses) the
first time ``deepspeed.ops.__compatible_ops__`` is read, which ``deepspeed.init_distributed`` does in every rank on
the CPU accelerator, and then loads its shared-memory collective operator; done here once, every forked rank
inherits the cached probe and the loaded operator (``tests/distributed/test_harness_accelerator.py`` checks the
forkserver still leaves CUDA alone)."""
import deepspeed
from deepspeed.accelerator import get_accelerator

from tests.support.frozen_heap import freeze_imports

if get_accelerator().device_name() == "cpu":
    deepspeed.ops.__compatible_ops__  # noqa: B018 - the probe, cached in the module
    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)

# Last, after every preload: the ranks forked from this server inherit their imports frozen (see frozen_heap).
freeze_imports()
