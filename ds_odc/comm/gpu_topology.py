"""Which GPUs the ranks of a ``cuda_ipc`` group use, and whether they can reach each other.

Pure functions over what every rank reports (host, pid, device UUID), so that every refusal is
testable on a CPU machine. The rules:

* every rank on one host (CUDA IPC does not cross machines);
* every rank's GPU visible to every other rank (a rank restricted by ``CUDA_VISIBLE_DEVICES`` to its
  own GPU cannot map a peer's memory);
* two ranks on different GPUs need peer access and native peer atomics between them (NVLink, or an
  NVSwitch): the push adds into a peer's memory with atomic reductions. Ranks sharing one GPU
  (e.g. tests) need neither.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

from ds_odc.errors import ODCConfigError


@dataclass(frozen=True)
class RankDevice:
    """What one rank reports about itself at allocation."""

    host: str
    pid: int
    uuid: str  # the GPU's UUID: the same GPU has the same UUID in every process


def resolve_peer_devices(devices: Sequence[RankDevice], rank: int, local_uuids: Sequence[str],
                         p2p: Callable[[int, int], Tuple[bool, bool]]) -> List[int]:
    """Local device index of every rank's GPU, as seen by ``rank``; raise ODCConfigError when the
    group cannot use CUDA IPC. ``p2p(mine, theirs)`` returns (peer access, native atomics).

    >>> gpus = ["GPU-a", "GPU-b"]
    >>> ranks = [RankDevice("h", 10, "GPU-a"), RankDevice("h", 11, "GPU-b"), RankDevice("h", 12, "GPU-a")]
    >>> resolve_peer_devices(ranks, 0, gpus, lambda a, b: (True, True))
    [0, 1, 0]
    """
    hosts = sorted({d.host for d in devices})
    if len(hosts) != 1:
        raise ODCConfigError(
            f"zero_optimization.odc.transport='cuda_ipc' maps the peers of one host, got hosts {hosts}: across "
            "nodes each node's ranks form their own cuda_ipc group, joined by zero_optimization.odc.cross_node "
            "('replicate' on GPUs; docs/multinode.md)")
    index_of = {uuid: i for i, uuid in enumerate(local_uuids)}
    mine = devices[rank].uuid
    if mine not in index_of:
        raise ODCConfigError(f"rank {rank}: its own GPU {mine} is not among the visible devices {list(local_uuids)}")
    indices = []
    for peer, device in enumerate(devices):
        if device.uuid not in index_of:
            raise ODCConfigError(
                f"rank {peer}'s GPU {device.uuid} is not visible to rank {rank} (visible: {list(local_uuids)}): "
                "CUDA IPC needs every GPU of the node visible to every rank; do not restrict "
                "CUDA_VISIBLE_DEVICES per rank (select the device with LOCAL_RANK instead)")
        theirs = index_of[device.uuid]
        if device.uuid != mine:
            access, atomics = p2p(index_of[mine], theirs)
            if not access:
                raise ODCConfigError(
                    f"GPUs {index_of[mine]} (rank {rank}) and {theirs} (rank {peer}) cannot access each other's "
                    "memory (no peer-to-peer path): zero_optimization.odc.transport='cuda_ipc' is not usable "
                    "on this node")
            if not atomics:
                raise ODCConfigError(
                    f"GPUs {index_of[mine]} (rank {rank}) and {theirs} (rank {peer}) have no native peer atomics "
                    "(PCIe without NVLink?): the cuda_ipc push adds into peers' memory atomically and cannot run "
                    "here; zero_optimization.odc.transport='cuda_ipc' needs NVLink/NVSwitch-connected GPUs")
        indices.append(theirs)
    return indices
