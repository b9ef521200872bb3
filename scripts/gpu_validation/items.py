"""What each phase runs, in order (the most telling first, so that a phase cut short by its budget has
still said the most): the same list on a GPU (``cuda_ipc``) and in the CPU smoke run (``shm``, smaller
selections, the CUDA-only items left to report themselves not measurable).

Correctness: set-up, the one-rank smoke test, the harness's accelerator checks, the JIT build from the installed wheel, the push kernel
against a CPU reference, the transport conformance suite, training parity, one rank on NCCL, the fault
matrix, peer atomics between distinct GPUs. Performance: set-up, the JIT build, pull/push bandwidth with
a ``push_max_blocks`` sweep (and NVLink and GEMM slowdown where there are two GPUs), batched vs per-piece
transfers, overlap on a small causal LM, and compute-sanitizer memcheck over the kernel sweep and a
two-process push.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from gpu_validation import verdicts
from gpu_validation.runner import Item, Status, Verdict

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Context:
    root: str
    work: str
    python: str
    wheels: str
    cpu_smoke: bool
    gpus: int
    sanitizer: Optional[str]
    cuda_home: Optional[str] = None
    """CUDA_HOME for the items, where torch's own guess would miss the toolkit (environment.cuda_home)"""

    @property
    def site(self) -> str:
        return os.path.join(self.work, "site")

    @property
    def transport(self) -> str:
        return "shm" if self.cpu_smoke else "cuda_ipc"

    def env(self, fresh_extensions: bool = False) -> dict:
        """Every item's environment: the installed packages first on PYTHONPATH, the transport the GPU
        suite runs on, and (on a GPU, or for the build probe) the kit's own torch extensions folder."""
        env = {"PYTHONPATH": os.pathsep.join(p for p in (self.site, os.environ.get("PYTHONPATH")) if p),
               "ODC_GPU_SUITE_TRANSPORT": self.transport, "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        if fresh_extensions or not self.cpu_smoke:
            env["TORCH_EXTENSIONS_DIR"] = os.path.join(self.work, "torch_extensions")
        if self.cpu_smoke:
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        if self.cuda_home:
            env["CUDA_HOME"] = self.cuda_home
        return env

    def pytest(self, name: str, title: str, paths: List[str], select: Optional[str], timeout_s: float) -> Item:
        command = [self.python, "-m", "pytest", *paths, "-p", "no:cacheprovider", "-q", "-rs",
                   "--junitxml={scratch}/junit.xml"]
        if select:
            command += ["-k", select]
        return Item(name, title, command, timeout_s, verdicts.pytest_verdict, self.env(), self.root)


def setup_item(ctx: Context) -> Item:
    return Item("setup", "install the carried wheels and a wheel of this checkout into a private folder",
                [ctx.python, os.path.join(HERE, "install.py"), "--root", ctx.root, "--wheels", ctx.wheels or "",
                 "--site", ctx.site, "--dist", os.path.join(ctx.work, "dist")], 240, verdicts.install_verdict,
                {"PYTHONUNBUFFERED": "1"}, ctx.root)


def jit_item(ctx: Context) -> Item:
    required = ["ds_odc_atomics"] if ctx.cpu_smoke else ["ds_odc_atomics", "ds_odc_cuda_ipc"]
    clean = os.path.join(ctx.work, "clean")
    os.makedirs(clean, exist_ok=True)
    return Item("jit-build", f"JIT build of {' and '.join(required)} from the installed wheel; python -m ds_odc report",
                [ctx.python, os.path.join(HERE, "jit_probe.py"), "--site", ctx.site, *required], 420,
                verdicts.jit_verdict, ctx.env(fresh_extensions=True), clean)


def _one_gpu(ctx: Context, what: str) -> str:
    if ctx.cpu_smoke:
        return f"{what}: a GPU run only"
    return f"{what} needs two GPUs; this machine has {ctx.gpus}" if ctx.gpus < 2 else ""


def correctness(ctx: Context) -> List[Item]:
    smoke = ctx.cpu_smoke
    t = ctx.transport
    distinct = ctx.pytest("peer-atomics-distinct-gpus", "concurrent pushes between ranks on distinct GPUs "
                          "(native peer atomics over NVLink)", ["tests/distributed/test_transport_conformance.py"],
                          "cuda_ipc and large_misaligned", 180)
    distinct.unavailable = _one_gpu(ctx, "peer atomics between distinct GPUs")
    return [
        setup_item(ctx),
        ctx.pytest("smoke", f"one rank, one step on {t}: the rank's accelerator, device and transport",
                   ["tests/gpu/test_cuda_smoke.py"], None, 240),
        ctx.pytest("harness", "ranks get the accelerator and backend they ask for; the forkserver's preloads leave "
                   "CUDA alone", ["tests/distributed/test_harness_accelerator.py"], None, 240),
        jit_item(ctx),
        ctx.pytest("kernel-sweep", "the push kernel against a CPU reference: every dtype, alignments 0-3, sizes "
                   "0-37, one 3,000,001-element push", ["tests/gpu/test_push_kernel.py"], None, 300),
        ctx.pytest("conformance", f"the transport contract on {t}, 2, 3 and 4 ranks on the one device",
                   ["tests/distributed/test_transport_conformance.py"],
                   "shm and (reads or large_misaligned)" if smoke else "cuda_ipc", 360),
        ctx.pytest("training-parity", "2 and 4 ranks vs one rank (fp32/bf16, equal/uneven, per-token) and vs "
                   "plain PyTorch", ["tests/gpu/test_cuda_training_parity.py"],
                   "2-fp32-token-uneven or 4-bf16-uneven" if smoke else "not nccl", 480),
        ctx.pytest("nccl-one-rank", "one rank on an NCCL process group equals one rank on gloo",
                   ["tests/gpu/test_cuda_training_parity.py"], "nccl", 240),
        ctx.pytest("fault-matrix", "SIGKILL at forward, push, fence; an owner dying mid-pull: the survivor raises "
                   "ODCPeerError naming it and its device still computes", ["tests/gpu/test_cuda_faults.py"],
                   "owner-dies-mid-pull" if smoke else None, 360),
        ctx.pytest("activation-offload", "saved activations through the pinned pool on copy and prefetch streams: "
                   "bit-identical, the long micro-batch's peak memory falls", ["tests/gpu/test_activation_offload_cuda.py"],
                   None, 240),
        distinct,
    ]


def performance(ctx: Context) -> List[Item]:
    env = ctx.env()
    no_gpu = "" if ctx.gpus else "no CUDA GPU is visible here"
    bandwidth = Item("transport-bandwidth", "pull and push against a device-to-device copy, 1-256 MiB, "
                     "push_max_blocks 4-64", [ctx.python, "benchmarks/gpu_transport.py", "--world", "2", "--sizes-mib",
                                              "1", "4", "16", "64", "256", "--push-blocks", "4", "8", "16", "32",
                                              "64", "--iters", "20", "--gemm-seconds", "2",
                                              "--json", "{scratch}/bandwidth.json", "--markdown",
                                              "{out}/gpu_transport.md"], 300, verdicts.bandwidth_verdict, env,
                     ctx.root, unavailable=no_gpu)
    nvlink = Item("nvlink-bandwidth", "pull and push bandwidth between distinct GPUs",
                  unavailable=_one_gpu(ctx, "NVLink bandwidth"),
                  derive=lambda done: _from(done, "transport-bandwidth", lambda r: Verdict(r.status, r.figures,
                                                                                           r.error)))
    gemm = Item("gemm-under-peer-traffic", "GEMM slowdown on a GPU while a peer pulls from / pushes into it",
                unavailable=_one_gpu(ctx, "another GPU's traffic slowing a GEMM"),
                derive=lambda done: _from(done, "transport-bandwidth", lambda r: verdicts.gemm_verdict(r.figures)))
    memcheck = [] if not ctx.sanitizer else [
        [ctx.sanitizer, "--tool", "memcheck", "--error-exitcode", "99", ctx.python, "-m", "pytest",
         "tests/gpu/test_push_kernel.py", "-p", "no:cacheprovider", "-q", "-x"],
        [ctx.sanitizer, "--tool", "memcheck", "--target-processes", "all", "--error-exitcode", "99", ctx.python, "-m",
         "pytest", "tests/distributed/test_transport_conformance.py", "-p", "no:cacheprovider", "-q", "-x", "-k",
         "cuda_ipc and large_misaligned"]]
    sanitizer_items = [Item(name, title, command, 240, verdicts.sanitizer_verdict, env, ctx.root,
                            unavailable=no_gpu or ("" if command else "compute-sanitizer is not installed here"))
                       for (name, title), command in zip(
                           [("memcheck-kernel-sweep", "compute-sanitizer memcheck over the push kernel sweep"),
                            ("memcheck-two-process-push", "compute-sanitizer memcheck over a 2-process push")],
                           memcheck or [None, None])]
    return [
        setup_item(ctx),
        jit_item(ctx),
        bandwidth,
        nvlink,
        gemm,
        Item("batched-vs-per-piece", "one read_many / accumulate_many against one transfer per piece, a gather of "
             "72 tensors", [ctx.python, "benchmarks/gpu_gather.py", "--world", "2", "--json", "{scratch}/gather.json"],
             240, verdicts.gather_verdict, env, ctx.root, unavailable=no_gpu),
        Item("overlap", "fraction of pull and push time beside compute, small causal LM, 2 ranks on the GPU, "
             "CUDA-event timeline", [ctx.python, "benchmarks/gpu_overlap.py", "--json", "{scratch}/overlap.json",
                                     "--png", "{out}/timeline.png"], 300, verdicts.overlap_verdict, env, ctx.root,
             unavailable=no_gpu),
        Item("activation-offload-memory", "peak device memory and forward+backward time against sequence length, "
             "activation offload off / all / planned and save_on_cpu, one rank",
             [ctx.python, "benchmarks/activation_offload.py", "--device", "cuda", "--lengths", "2048", "4096", "8192",
              "16384", "--dim", "1024", "--layers", "8", "--json", "{scratch}/activation_offload.json"],
             420, verdicts.activation_offload_verdict, env, ctx.root, unavailable=no_gpu),
        *sanitizer_items,
    ]


def _from(done: dict, name: str, verdict_of) -> Verdict:
    """A verdict read from an earlier item's result (inconclusive if that item did not pass or fail)."""
    result = done.get(name)
    if result is None or result.status not in (Status.PASS, Status.FAIL):
        return Verdict(Status.INCONCLUSIVE, error=f"{name} did not measure it")
    return verdict_of(result)
