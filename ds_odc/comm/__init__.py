"""Transports: where shards live and how peers reach them. Nothing here knows about DeepSpeed."""
from ds_odc.comm.transport import Transport, WindowSpec
from ds_odc.comm.shm import ShmTransport

__all__ = ["Transport", "WindowSpec", "ShmTransport", "create_transport"]


def create_transport(name: str, *, rank: int, world_size: int, timeout_s: float, device: str = "cpu",
                     shm_dir: str = "/dev/shm", stripe_numel: int = 1 << 20, group=None) -> Transport:
    """Build the transport named in ``odc.transport`` ("auto" picks by the device of the shards)."""
    if name == "auto":
        name = "shm" if device == "cpu" else "cuda_ipc"
    if name == "shm":
        return ShmTransport(rank, world_size, timeout_s, shm_dir=shm_dir, stripe_numel=stripe_numel, group=group)
    raise NotImplementedError(
        f"odc.transport={name!r} is not available in this build; tensors on {device!r} need it. "
        "Available: 'shm' (CPU, one host).")
