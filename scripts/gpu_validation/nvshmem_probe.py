"""The kit's ``nvshmem`` item: NVSHMEM through nvshmem4py on this machine's GPU, in the shape a multi-rank
(multi-node) job uses, so that cross-node global sharding on GPUs has its first measured footing.

    PYTHONPATH=<nvshmem site>:<site> python nvshmem_probe.py --elements 67108864

* bootstrap: torch.distributed (gloo; ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` when a launcher
  set them, else one rank on a free local port); rank 0 makes NVSHMEM's unique id, ``broadcast_object_list``
  hands its bytes to every rank, every rank calls ``nvshmem.core.init(..., initializer_method="uid")``;
* symmetric heap: a bf16 window of ``--elements`` (64M: a 128 MiB window), a bf16 inbox and a bf16 landing
  buffer of the same size, and an fp32 accumulator (256 MiB), each one ``nvshmem.core.tensor``;
* get and put with the peer ``(my_pe + 1) % n_pes`` (the own PE with one PE): the stream-ordered
  non-blocking forms (``get_nbi`` / ``put_nbi``, i.e. ``nvshmemx_{get,put}mem_nbi_on_stream``) then
  ``quiet`` on the same stream; the bytes must equal the peer's window, which every rank can compute
  (each PE's window is drawn from a generator seeded by its PE number); each timed with CUDA events against a
  torch copy of the same bytes (GB/s = bytes moved / s);
* the push's owner side: ``acc.add_(inbox)`` (an fp32 accumulator plus the pushed bf16, converted in the
  kernel, no temporary) must equal torch's ``acc += x.float()`` bit for bit; both timed (GB/s counts the
  10 bytes per element the add moves: 2 read, 4 read, 4 written);
* the symmetric tensors are freed and NVSHMEM finalized, also after a failure.

Not exercised: device-initiated transfers (``nvshmemx_getmem_nbi_block`` / ``putmem_nbi_block`` inside a
kernel, what sail-sg/odc's reference issues): they need a kernel linked against libnvshmem_device
(numba-cuda or CuTe DSL through nvshmem4py, or nvcc -rdc), which the kit does not carry. The host-initiated
on-stream forms above go through the same symmetric heap and transports.

Prints ``NVSHMEM {json}`` (and ``NVSHMEM_STAGE`` lines as it goes, so a hang is located); exit 1 when a check
fails. Without nvshmem4py, without a CUDA build of torch or without a GPU it prints ``not_measurable`` with
the reason and exits 0. Imports nothing from ds_odc.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import sys
import time
from typing import Iterable, List, Optional

HOST_LIBRARY = os.path.join("nvidia", "nvshmem", "lib", "libnvshmem_host.so.3")
#: bytes per element of the add: the bf16 read, the fp32 accumulator read and written
ADD_BYTES_PER_ELEMENT = 2 + 4 + 4


def say(tag: str, figures: dict) -> None:
    print(f"{tag} " + json.dumps(figures, default=str), flush=True)


def stage(name: str, **detail) -> None:
    say("NVSHMEM_STAGE", {"stage": name, **detail})


def find_host_library(paths: Iterable[str]) -> Optional[str]:
    """libnvshmem_host.so.3 of an nvidia-nvshmem wheel on ``paths`` (sys.path): cuda.pathfinder looks in the
    interpreter's site-packages, not in a folder on PYTHONPATH, so a carried library is loaded from here first."""
    for entry in paths:
        candidate = os.path.join(entry or ".", HOST_LIBRARY)
        if os.path.isfile(candidate):
            return candidate
    return None


def nvshmem_environment(world: int, symmetric_bytes: int, environ=None) -> dict:
    """NVSHMEM settings the item needs unless the caller set them: a symmetric heap that holds the buffers
    (with room to spare); with one rank, the loopback interface for the uid bootstrap and no remote transport
    (a multi-node job sets its NIC and keeps NVSHMEM's remote transport)."""
    environ = os.environ if environ is None else environ
    wanted = {"NVSHMEM_SYMMETRIC_SIZE": str(symmetric_bytes + symmetric_bytes // 2 + (64 << 20))}
    if world == 1:
        wanted.update(NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME="lo", NVSHMEM_REMOTE_TRANSPORT="none")
    return {key: value for key, value in wanted.items() if key not in environ}


def uid_bytes(uid) -> bytes:
    """The bytes of an nvshmem4py unique id (``nvshmemx_uniqueid_v1``, 128 bytes)."""
    import numpy as np

    return uid._data.view(np.uint8).tobytes()


def load_uid(empty, raw: bytes):
    """Fill an empty unique id (``get_unique_id(empty=True)``) with the bytes rank 0 broadcast."""
    import numpy as np

    target = empty._data.view(np.uint8)
    if target.nbytes != len(raw):
        raise ValueError(f"a unique id of {len(raw)} bytes for a structure of {target.nbytes}")
    target[:] = np.frombuffer(raw, dtype=np.uint8)
    return empty


def broadcast_uid(dist, rank: int, make, empty):
    """Rank 0 makes the id (``make()``), every rank gets its bytes over torch.distributed."""
    box: List[Optional[bytes]] = [uid_bytes(make()) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return load_uid(empty(), box[0])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TorchStream:
    """A torch stream in the ``__cuda_stream__`` protocol nvshmem4py's on-stream calls read."""

    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


def timed(torch, body, iters: int, warmup: int) -> float:
    """Seconds per call of ``body`` on the current stream, from CUDA events."""
    for _ in range(warmup):
        body()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        body()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / iters


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=64 << 20, help="window elements (bf16); default 64M")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    figures: dict = {"elements": args.elements}
    try:
        import nvshmem
        import nvshmem.core as shmem
    except ImportError as err:
        figures["not_measurable"] = f"nvshmem4py is not installed here ({err}); scripts/gpu_kit.sh carries it"
        say("NVSHMEM", figures)
        return 0
    import torch

    if torch.version.cuda is None or not torch.cuda.is_available():
        figures["not_measurable"] = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None
                                     else "no CUDA device is visible")
        say("NVSHMEM", figures)
        return 0
    import torch.distributed as dist
    from cuda.core import Device

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    n = args.elements
    symmetric = n * (2 + 2 + 2 + 4)  # window, landing buffer, inbox (bf16), accumulator (fp32)
    settings = nvshmem_environment(world, symmetric)
    os.environ.update(settings)
    figures.update(nvshmem4py=getattr(nvshmem, "__version__", None), torch=torch.__version__,
                   device=torch.cuda.get_device_name(local_rank), set_for_the_item=settings,
                   window_mib=n * 2 / 2**20, accumulator_mib=n * 4 / 2**20)
    host = find_host_library(sys.path)
    if host:
        ctypes.CDLL(host, mode=ctypes.RTLD_GLOBAL)
    figures["host_library"] = host or "found by cuda.pathfinder (the interpreter's nvidia-nvshmem, e.g. torch's)"
    problems: List[str] = []
    seconds: dict = {}
    tensors: list = []
    initialized = False
    clock = time.monotonic()
    try:
        torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        stage("process group", rank=rank, world=world)
        uid = broadcast_uid(dist, rank, shmem.get_unique_id, lambda: shmem.get_unique_id(empty=True))
        device = Device(local_rank)
        device.set_current()
        shmem.init(device=device, uid=uid, rank=rank, nranks=world, initializer_method="uid")
        initialized = True
        seconds["bootstrap_and_init"] = round(time.monotonic() - clock, 2)
        me, pes = shmem.my_pe(), shmem.n_pes()
        peer, source = (me + 1) % pes, (me - 1) % pes
        version = shmem.get_version()
        figures.update(bootstrap=f"uid: rank 0 get_unique_id, torch.distributed gloo broadcast_object_list to "
                                 f"{world} rank(s), init(initializer_method='uid')", my_pe=me, n_pes=pes, peer=peer,
                       libnvshmem=getattr(version, "libnvshmem_version", str(version)))
        stage("initialized", my_pe=me, n_pes=pes, libnvshmem=figures["libnvshmem"])

        def symmetric_tensor(dtype):
            made = shmem.tensor((n,), dtype=dtype)  # a collective: every PE allocates in the same order
            tensors.append(made)
            return made

        clock = time.monotonic()
        window, landing, inbox = (symmetric_tensor(torch.bfloat16) for _ in range(3))
        acc = symmetric_tensor(torch.float32)
        seconds["allocate"] = round(time.monotonic() - clock, 2)

        def window_of(pe):
            generator = torch.Generator(device="cuda").manual_seed(1234 + pe)
            return torch.randn(n, generator=generator, device="cuda", dtype=torch.float32).to(torch.bfloat16)

        window.copy_(window_of(me))
        acc.copy_(torch.randn(n, generator=torch.Generator(device="cuda").manual_seed(99 + me), device="cuda"))
        landing.zero_()
        inbox.zero_()
        torch.cuda.synchronize()
        dist.barrier()  # every window is written before any PE reads one
        stream = TorchStream(torch.cuda.current_stream())

        def get():
            shmem.get_nbi(landing, window, remote_pe=peer, stream=stream)
            shmem.quiet(stream=stream)

        def put():
            shmem.put_nbi(inbox, window, remote_pe=peer, stream=stream)
            shmem.quiet(stream=stream)

        get()
        torch.cuda.synchronize()
        expected = window_of(peer)
        get_equal = torch.equal(landing.view(torch.int16), expected.view(torch.int16))
        put()
        torch.cuda.synchronize()
        dist.barrier()  # the PE that puts into this one has finished
        pushed = window_of(source)
        put_equal = torch.equal(inbox.view(torch.int16), pushed.view(torch.int16))
        reference = acc.clone()
        reference += pushed.float()
        acc.add_(inbox)  # the owner's half of a push: the pushed bf16 into the fp32 accumulator
        torch.cuda.synchronize()
        add_exact = torch.equal(acc, reference)
        add_max = float((acc - reference).abs().max())
        del expected, reference
        stage("checked", get_equal=get_equal, put_equal=put_equal, add_exact=add_exact)
        if not get_equal:
            problems.append(f"get_nbi from PE {peer}: the bytes differ from that PE's window")
        if not put_equal:
            problems.append(f"put_nbi from PE {source}: the inbox's bytes differ from that PE's window")
        if not add_exact:
            problems.append(f"acc.add_(bf16 inbox) differs from torch's acc += x.float() (max {add_max})")

        nbytes = n * 2
        t_get = timed(torch, get, args.iters, args.warmup)
        t_put = timed(torch, put, args.iters, args.warmup)
        t_copy = timed(torch, lambda: landing.copy_(window), args.iters, args.warmup)
        t_add = timed(torch, lambda: acc.add_(inbox), args.iters, args.warmup)
        t_add_ref = timed(torch, lambda: acc.add_(inbox.float()), args.iters, args.warmup)
        torch.cuda.synchronize()
        dist.barrier()
        figures.update(
            get={"bytes_equal": get_equal, "gbps": round(nbytes / t_get / 1e9, 1), "ms": round(1e3 * t_get, 3),
                 "over_torch_copy": round(t_copy / t_get, 3)},
            put={"bytes_equal": put_equal, "gbps": round(nbytes / t_put / 1e9, 1), "ms": round(1e3 * t_put, 3),
                 "over_torch_copy": round(t_copy / t_put, 3)},
            torch_copy={"gbps": round(nbytes / t_copy / 1e9, 1), "ms": round(1e3 * t_copy, 3)},
            accumulate={"op": "acc.add_(x) (fp32 += bf16, in the kernel)", "exact": add_exact,
                        "max_abs_diff": add_max, "gbps": round(n * ADD_BYTES_PER_ELEMENT / t_add / 1e9, 1),
                        "ms": round(1e3 * t_add, 3),
                        "reference": {"op": "acc += x.float()", "ms": round(1e3 * t_add_ref, 3)},
                        "bytes_per_element": ADD_BYTES_PER_ELEMENT},
            iters=args.iters, timing="CUDA events, get/put each followed by quiet on the same stream",
            device_initiated="not exercised (getmem_nbi_block / putmem_nbi_block need a kernel linked against "
                             "libnvshmem_device)")
    except Exception as err:  # noqa: BLE001 - reported, and NVSHMEM still finalized below
        problems.append(f"{type(err).__name__}: {err}")
    finally:
        for made in tensors:
            try:
                shmem.free_tensor(made)
            except Exception as err:  # noqa: BLE001
                problems.append(f"free_tensor: {type(err).__name__}: {err}")
        tensors.clear()
        if initialized:
            try:
                shmem.finalize()
                figures["finalized"] = True
            except Exception as err:  # noqa: BLE001
                figures["finalized"] = False
                problems.append(f"finalize: {type(err).__name__}: {err}")
        if dist.is_initialized():
            dist.destroy_process_group()
    figures.update(seconds=seconds, problems=problems)
    say("NVSHMEM", figures)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
