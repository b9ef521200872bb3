"""What each of the kit's two commands runs, in order of what an item tells per second of GPU time, so that a
command cut short has still said the most.

First command (default budget 330 s): the machine -> set-up and the CUDA operator -> the push kernel against
a CPU reference (one process) -> a one-rank smoke run from the installed wheel -> the transport conformance
core on ``cuda_ipc`` -> training parity -> one fault -> push against a local add and pull against its own
copy -> overlap from the CUDA-event timeline.

Second command (``--second``, default budget 290 s, only if time is left): one rank on NCCL, activation
offload (test and peak-memory benchmark), parameter offload with the model on the GPU against ZeRO-3,
batched gathers, the rest of the fault matrix, offload_states / reload_states on cuda_ipc (the windows freed
and mapped again), fp16 against ZeRO-3's fp16 with an overflow step (the refusal lifted for the run), one
long sample split over ranks, NVSHMEM through nvshmem4py on one PE (nvshmem_probe.py; its wheels in a folder
of their own), a JIT build into an empty folder, compute-sanitizer over the kernel sweep.

The same lists run in the CPU smoke run (``shm``, smaller selections; the CUDA-only items report themselves
not measurable). Every item runs from the copy of the tests that the set-up lays out (``Context.suite``),
so that it imports the installed wheel's ``ds_odc``. Timeouts are at most 90 s (no hang costs more);
``expect_s`` is an item's usual time, below which it is not started.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional

from gpu_validation import verdicts
from gpu_validation.runner import Item

HERE = os.path.dirname(os.path.abspath(__file__))
HANG_S = 90.0  # the longest any one item may run: no single hang costs more


@dataclass
class Context:
    root: str
    work: str
    python: str
    wheels: str
    prebuilt: str
    cpu_smoke: bool
    machine: dict = field(default_factory=dict)
    """what the machine item read (environment.describe); empty before it ran"""

    @property
    def site(self) -> str:
        return os.path.join(self.work, "site")

    @property
    def suite(self) -> str:
        return os.path.join(self.work, "suite")

    @property
    def nvshmem_site(self) -> str:
        """the carried NVSHMEM wheels (install.py), on PYTHONPATH for the nvshmem item only"""
        return os.path.join(self.work, "site-nvshmem")

    @property
    def transport(self) -> str:
        return "shm" if self.cpu_smoke else "cuda_ipc"

    @property
    def gpus(self) -> int:
        return int(self.machine.get("gpus") or 0)

    @property
    def sharing(self) -> dict:
        return self.machine.get("sharing") or {"shared": True, "why": "", "time_sliced": True, "mig": False}

    def env(self, extensions: Optional[str] = None, nvshmem: bool = False) -> dict:
        """Every item's environment: the installed packages first on PYTHONPATH (and named, for the check
        that they are what is imported), the transport the GPU suite runs on, the torch extensions folder
        shared by every item of this work folder (``extensions``: another one); ``nvshmem``: the NVSHMEM
        wheels' folder before them (the nvshmem item only)."""
        first = (self.nvshmem_site, self.site) if nvshmem else (self.site,)
        env = {"PYTHONPATH": os.pathsep.join(p for p in (*first, os.environ.get("PYTHONPATH")) if p),
               "ODC_KIT_SITE": self.site, "ODC_GPU_SUITE_TRANSPORT": self.transport, "PYTHONUNBUFFERED": "1"}
        if extensions or not self.cpu_smoke:  # on CPU: the caller's folder, where make venv built DeepSpeed's ops
            env["TORCH_EXTENSIONS_DIR"] = extensions or os.path.join(self.work, "torch_extensions")
        if self.cpu_smoke:
            env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        cuda_home = (self.machine.get("cuda_home") or {}).get("set")
        if cuda_home:
            env["CUDA_HOME"] = cuda_home
        return env

    def gpu_only(self, what: str, world: int = 1) -> str:
        """Why ``what`` (run by ``world`` processes) cannot run here; empty when it can."""
        if self.cpu_smoke:
            return f"{what}: a GPU run only"
        if not self.gpus:
            return "no CUDA GPU is visible here"
        return self.cannot_share(world)

    def cannot_share(self, world: int) -> str:
        """Several processes on one GPU are refused in Exclusive_Process / Prohibited compute mode."""
        if self.cpu_smoke or world <= 1 or self.gpus >= world or self.sharing["shared"]:
            return ""
        return f"{world} ranks on {self.gpus} GPU(s): {self.sharing['why']}"

    def time_slice_note(self, world: int) -> str:
        """Ranks sharing one GPU without MPS take turns on it."""
        if self.cpu_smoke or self.gpus >= world or not self.sharing["time_sliced"]:
            return ""
        return (f"{world} ranks share {self.gpus} GPU(s) without MPS: the GPU time-slices their contexts, so their "
                "kernels do not run at the same time. A pass shows exact sums under concurrently issued pushes, "
                "not pushes executing concurrently on the device.")

    def pytest(self, name: str, title: str, paths: List[str], select: Optional[str], expect_s: float,
               world: int = 1, timeout_s: float = HANG_S) -> Item:
        # -v: each test's name is printed as it starts, so current-item.txt names a test that hangs
        command = [self.python, "-m", "pytest", *paths, "-p", "no:cacheprovider", "-p", "kit_installed_check", "-v",
                   "-rs", "--junitxml={scratch}/junit.xml"]
        if select:
            command += ["-k", select]
        return Item(name, title, command, timeout_s, verdicts.pytest_verdict, self.env(), self.suite,
                    unavailable=self.cannot_share(world), expect_s=expect_s)


# -- the items every command starts with ---------------------------------------------------------------
def machine_item(ctx: Context) -> Item:
    return Item("machine", "the machine: GPUs, driver, compute mode, MIG, MPS, torch and its CUDA, Python, nvcc",
                [ctx.python, os.path.join(HERE, "environment.py")], 60, verdicts.machine_verdict(ctx.cpu_smoke),
                {"PYTHONUNBUFFERED": "1"}, ctx.root, expect_s=5, required=True)


def setup_item(ctx: Context) -> Item:
    command = [ctx.python, os.path.join(HERE, "install.py"), "--root", ctx.root, "--wheels", ctx.wheels or "",
               "--site", ctx.site, "--nvshmem-site", ctx.nvshmem_site, "--dist", os.path.join(ctx.work, "dist"),
               "--suite", ctx.suite]
    return Item("setup", "install the carried wheels and a wheel of this checkout into a private folder (the NVSHMEM "
                "wheels into one of their own); copy the tests there", command, HANG_S, verdicts.install_verdict,
                {"PYTHONUNBUFFERED": "1"}, ctx.root, expect_s=15, required=True)


def cuda_op_item(ctx: Context) -> Item:
    return Item("cuda-op", "the CUDA operator: the carried prebuilt one when its fingerprint matches, else a build "
                "(which one, and why, is said)", [ctx.python, os.path.join(HERE, "cuda_op.py"), "--prebuilt",
                                                  ctx.prebuilt], HANG_S, verdicts.cuda_op_verdict, ctx.env(),
                ctx.work, expect_s=5, required=True)


def preamble(ctx: Context) -> List[Item]:
    """Run first by both commands (``--only`` keeps them): the machine item is run before this list is made."""
    return [setup_item(ctx), cuda_op_item(ctx)]


# -- first command ------------------------------------------------------------------------------------
def first(ctx: Context) -> List[Item]:
    smoke, t = ctx.cpu_smoke, ctx.transport
    conformance = ["tests/distributed/test_transport_conformance.py"]
    core = ctx.pytest("conformance-core", f"the transport contract on {t}: 3 ranks reading every owner; 4 ranks "
                      "pushing fp32 into one owner at once (one by one and accumulate_many)", conformance,
                      f"{t} and (reads or (concurrent and fp32{' and one-by-one' if smoke else ''}))", 35, world=4)
    core.note = ctx.time_slice_note(4)
    bandwidth = Item("bandwidth", "push against a local acc.add_(grad) of the same elements, pull against its own "
                     "copy; 64 and 256 MiB, a push block sweep (device wave and fewer)",
                     [ctx.python, "benchmarks/gpu_transport.py", "--world", "2", "--sizes-mib", "64", "256",
                      "--push-blocks", "auto", "264", "132", "66", "--iters", "10", "--gemm-seconds", "1",
                      "--json", "{scratch}/bandwidth.json", "--markdown", "{out}/gpu_transport.md"], HANG_S,
                     verdicts.bandwidth_verdict, ctx.env(), ctx.suite,
                     unavailable=ctx.gpu_only("bandwidth against a local add", world=2), expect_s=30,
                     note="MIG is enabled: the figures are one GPU instance's" if ctx.sharing["mig"] else "")
    overlap = Item("overlap", "fraction of pull and push time beside compute, small causal LM, 2 ranks, 3 steps, from "
                   "the CUDA-event timeline", [ctx.python, "benchmarks/gpu_overlap.py", "--steps", "3", "--warmup", "1",
                                               "--timeout", "80", "--json", "{scratch}/overlap.json", "--png",
                                               "{out}/timeline.png"], HANG_S, verdicts.overlap_verdict, ctx.env(),
                   ctx.suite, unavailable=ctx.gpu_only("overlap on a GPU timeline", world=2), expect_s=35,
                   note=ctx.time_slice_note(2))
    return [
        ctx.pytest("kernel-sweep", "the push kernel against a CPU reference in one process: every dtype, alignments "
                   "0-3, sizes 0-37, a grid-stride case, one 3,000,001-element push", ["tests/gpu/test_push_kernel.py"],
                   None, 15),
        ctx.pytest("smoke", f"one rank, one step on {t} from the installed wheel: the rank's accelerator, device and "
                   "transport", ["tests/gpu/test_cuda_smoke.py"], None, 20),
        core,
        ctx.pytest("conformance-edges", f"on {t}: a large misaligned push; a dead pusher named at the fence",
                   conformance, f"{t} and large_misaligned" if smoke else f"{t} and (large_misaligned or dead_pusher)",
                   25, world=2),
        ctx.pytest("parity-2-fp32", "2 ranks, fp32, equal counts, against one process on the same global batch",
                   ["tests/gpu/test_cuda_training_parity.py"], "ranks_sharing and 2-fp32-equal", 25, world=2),
        ctx.pytest("parity-4-bf16-token", "4 ranks, bf16, per-token normalisation, uneven counts, against one process",
                   ["tests/gpu/test_cuda_training_parity.py"], "ranks_sharing and 4-bf16-token-uneven", 30, world=4),
        ctx.pytest("fault-push", "SIGKILL during a push: the survivor raises ODCPeerError naming the rank within 15 s "
                   "and its device stays usable", ["tests/gpu/test_cuda_faults.py"], "push", 25, world=2),
        bandwidth,
        overlap,
    ]


# -- second command -----------------------------------------------------------------------------------
def second(ctx: Context) -> List[Item]:
    fresh = os.path.join(ctx.work, "items", "jit-build", "fresh_extensions")
    required = ["ds_odc_atomics"] + ([] if ctx.cpu_smoke else ["ds_odc_cuda_ipc"])
    jit = Item("jit-build", f"JIT build of {' and '.join(required)} from the installed wheel into an empty extensions "
               "folder; python -m ds_odc report", [ctx.python, os.path.join(HERE, "jit_probe.py"), "--site", ctx.site,
                                                  "--fresh", fresh, *required], HANG_S, verdicts.jit_verdict,
               ctx.env(extensions=fresh), ctx.work, expect_s=40)
    sanitizer = ctx.machine.get("compute_sanitizer")
    memcheck = Item("memcheck-kernel-sweep", "compute-sanitizer memcheck over the push kernel sweep",
                    [sanitizer or "compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", ctx.python, "-m",
                     "pytest", "tests/gpu/test_push_kernel.py", "-p", "no:cacheprovider", "-p", "kit_installed_check",
                     "-v", "-x", "--junitxml={scratch}/junit.xml"], HANG_S, verdicts.sanitizer_verdict, ctx.env(),
                    ctx.suite, unavailable=ctx.gpu_only("memcheck") or ("" if sanitizer else
                                                                         "compute-sanitizer is not installed here"),
                    expect_s=45)
    offload_memory = Item("activation-offload-memory", "peak device memory and forward+backward time against "
                          "sequence length: activation offload off / all / planned and save_on_cpu, one rank",
                          [ctx.python, "benchmarks/activation_offload.py", "--device", "cuda", "--lengths", "2048",
                           "4096", "8192", "16384", "--dim", "1024", "--layers", "8", "--repeats", "3", "--json",
                           "{scratch}/activation_offload.json"], HANG_S, verdicts.activation_offload_verdict,
                          ctx.env(), ctx.suite, unavailable=ctx.gpu_only("peak GPU memory"), expect_s=50)
    gathers = Item("batched-gathers", "one read_many / accumulate_many against one transfer per piece, a gather of 72 "
                   "tensors", [ctx.python, "benchmarks/gpu_gather.py", "--world", "2", "--iters", "20", "--timeout",
                               "80", "--json", "{scratch}/gather.json"], HANG_S, verdicts.gather_verdict, ctx.env(),
                   ctx.suite, unavailable=ctx.gpu_only("batched gathers on a GPU", world=2), expect_s=30)
    split_memory = Item("split-memory", "one long sample (16K tokens) whole on one rank against split over 2 and 4 "
                        "ranks (policy lb-mini-split, token_cap forcing the split): each rank's peak GPU memory over "
                        "forward and backward", [ctx.python, "benchmarks/split_memory.py", "--device", "cuda",
                                                 "--length", "16384", "--repeats", "1", "--json",
                                                 "{scratch}/split_memory.json"], HANG_S, verdicts.split_memory_verdict,
                        ctx.env(), ctx.suite, unavailable=ctx.gpu_only("peak GPU memory of split samples", world=4),
                        expect_s=90)
    nvshmem = nvshmem_item(ctx)
    return [
        ctx.pytest("nccl-one-rank", "one rank on an NCCL process group equals one rank on gloo",
                   ["tests/gpu/test_cuda_training_parity.py"], "nccl", 25),
        ctx.pytest("activation-offload", "saved activations through the pinned pool on copy and prefetch streams: "
                   "bit-identical, the long micro-batch's peak memory falls",
                   ["tests/gpu/test_activation_offload_cuda.py"], None, 30),
        offload_memory,
        gathers,
        ctx.pytest("param-offload", "offload_param with the model on the GPU (host-window pulls and pushes) against "
                   "ZeRO-3 with the same offload, one rank on NCCL", ["tests/gpu/test_cuda_param_offload.py"], None,
                   30),
        ctx.pytest("fault-matrix-rest", "SIGKILL at forward and at the fence, an owner dying mid-pull: the survivor "
                   "raises ODCPeerError naming it and its device still computes", ["tests/gpu/test_cuda_faults.py"],
                   "not push", 60, world=2),
        ctx.pytest("offload-states", "engine.offload_states() / reload_states() on cuda_ipc: the windows' device "
                   "memory is free while away, and training after the calls equals training without, bit for bit",
                   ["tests/gpu/test_cuda_offload_states.py"], None, 40, world=2),
        ctx.pytest("fp16", "fp16 (DS_ODC_EXPERIMENTAL_FP16=1) against ZeRO-3's fp16 with an overflow step, one rank "
                   "on NCCL: the same steps skipped, the same loss scales, the same parameters",
                   ["tests/gpu/test_cuda_fp16.py"], None, 25),
        split_memory,
        nvshmem,
        ctx.pytest("examples", "the examples as written, one rank on the GPU the environment gives (no accelerator "
                   "named): the causal LM, the HF Trainer with the balance block, TRL SFT, LoRA, mixture of experts",
                   ["tests/gpu/test_examples_cuda.py"], None, 150),
        # -- Later items go here, before the two slow checks below.
        jit,
        memcheck,
    ]


#: The nvshmem item's window: 64M bf16 elements (128 MiB), with a 256 MiB fp32 accumulator.
NVSHMEM_ELEMENTS = 64 << 20


def nvshmem_item(ctx: Context) -> Item:
    """NVSHMEM through the carried nvshmem4py (nvshmem_probe.py): not measurable on CPU and, said by the probe,
    where nvshmem4py is not installed."""
    return Item("nvshmem", "nvshmem4py on one PE: uid bootstrap over torch.distributed, a bf16 window of "
                f"{NVSHMEM_ELEMENTS >> 20}M elements and an fp32 accumulator on the symmetric heap, get/put (on-stream "
                "nbi + quiet) against torch copies, bf16 -> fp32 accumulate, finalize",
                [ctx.python, os.path.join(HERE, "nvshmem_probe.py"), "--elements", str(NVSHMEM_ELEMENTS)], HANG_S,
                verdicts.nvshmem_verdict, ctx.env(nvshmem=True), ctx.work,
                unavailable=ctx.gpu_only("NVSHMEM's symmetric heap on a GPU"), expect_s=25,
                note="one PE: get and put reach the own PE (intra-GPU); device-initiated *_nbi_block transfers are "
                     "not exercised")


def select(items: List[Item], only: Optional[List[str]]) -> List[Item]:
    """``--only``: the named items, in their order, and the required ones (raises naming unknown names)."""
    if not only:
        return items
    known = {item.name for item in items}
    unknown = sorted(set(only) - known)
    if unknown:
        raise SystemExit(f"--only: no item named {unknown}; items: {[item.name for item in items]}")
    return [item for item in items if item.name in only or item.required]
