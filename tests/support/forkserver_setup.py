"""Imported first by the harness's forkserver (``harness.PRELOAD``), before torch: the forkserver's own
process settings, inherited by every rank forked from it.

``PYTORCH_NVML_BASED_CUDA_CHECK=1``: torch then answers ``torch.cuda.is_available()`` and
``device_count()`` from NVML instead of ``cudaGetDeviceCount``. The preloads need it: importing DeepSpeed's
Muon optimizer builds a ``torch.compile`` wrapper, which imports ``torch._inductor``, whose
``runtime/benchmarking.py`` calls ``torch.cuda.is_available()`` at import. With a CUDA build of torch
that call initialises the CUDA driver in the forkserver and marks every rank forked from it a "bad fork"
(``torch.cuda._is_in_bad_fork()``: any CUDA call there fails). Found by the validation kit's rehearsal on
torch 2.11.0+cu130; tests/distributed/test_harness_accelerator.py checks it. (CUDA ranks never come
from the forkserver: they are spawned.)
"""
import os

os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
