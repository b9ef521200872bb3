"""Opening an ODC session: nodes -> layout -> transport -> cross-node link -> step protocol, in one place.

An engine adapter (``ds_odc.integration``) says what it has in a :class:`SessionPlan` (its shards, their
dtype and device, how many norm groups its optimizer has, the options) and calls :func:`open_session`
once. Everything collective about starting up happens here, in this order, on every rank:

1. the job's nodes (one ``all_gather_object`` of host names; the groups of a multi-node job);
2. the window layout, from the plan's shards (pure math, no communication);
3. the node's transport, whose allocation is all-or-nothing within the node;
4. one agreement across nodes on that outcome (several nodes only): a ``/dev/shm`` too small on one
   node fails every rank of every node with that node's error;
5. the link with the other nodes, and the runtime (pull, push, and the step protocol) over all of it.

After this, nothing ODC does is collective outside its rounds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as tdist

from ds_odc.comm import WindowSpec, create_transport
from ds_odc.comm.nodes import JobNodes, job_nodes
from ds_odc.comm.remote import RemoteWindows
from ds_odc.errors import ODCConfigError
from ds_odc.runtime.core import ODCRuntime
from ds_odc.runtime.cross_node_plan import CrossNodeChoice, ModelStates, resolve_cross_node
from ds_odc.runtime.layout import WindowLayout
from ds_odc.runtime.ledger import MicroBatchLedger
from ds_odc.runtime.round_kinds import PROTOCOL_WORDING


@dataclass(frozen=True)
class Shard:
    """One parameter as the windows see it: its key, full size, and the (padded) size each owner holds."""

    key: int
    numel: int
    shard_numel: int


@dataclass(frozen=True)
class SessionPlan:
    """What an engine asks of a session. ``trainable`` in the order of its optimizer's flat shard buffer
    (the window's trainable part *is* that buffer); ``frozen`` after it."""

    trainable: Sequence[Shard]
    frozen: Sequence[Shard]
    compute_dtype: torch.dtype
    device: str
    norm_groups: int
    timeout_s: float
    transport: str = "auto"
    shm_dir: str = "/dev/shm"
    stripe_numel: int = 1 << 20
    accumulator_dtype: torch.dtype = torch.float32
    #: deterministic accumulation: two fp64 regions per accumulator ([Note: exact sums]); accumulator_dtype ignored
    exact: bool = False
    ledger: MicroBatchLedger = field(default_factory=MicroBatchLedger)
    #: zero_optimization.odc.cross_node ("replicate", "global", "auto") and node_replica_budget_gb
    cross_node: str = "replicate"
    replica_budget_gb: Optional[float] = None
    #: ZeRO offloads in use ("offload_param", "offload_optimizer"): not yet tested with owners on other nodes
    offloads: tuple = ()

    def layout(self, node_count: int) -> WindowLayout:
        layout = WindowLayout(node_count)
        for shard in self.trainable:
            layout.add_trainable(shard.key, shard.numel, shard.shard_numel)
        for shard in self.frozen:
            layout.add_frozen(shard.key, shard.numel, shard.shard_numel)
        return layout


def open_session(plan: SessionPlan, on_open: Optional[Callable[[], None]] = None,
                 nodes: Optional[JobNodes] = None) -> ODCRuntime:
    """Start ODC on every rank (collective; see the module docstring). ``on_open``: the open round's
    hook (publish shards written since). ``nodes``: the job's nodes when the caller found them already."""
    if plan.cross_node != "replicate" and torch.device(plan.device).type != "cpu":
        raise ODCConfigError(f"zero_optimization.odc.cross_node={plan.cross_node!r} runs on CPU hosts for now: on GPUs "
                             "pulls and pushes across nodes need the NVSHMEM transport, which is validated only as an "
                             "item of the GPU kit (docs/gpu.md); use 'replicate' (the default)")
    nodes = nodes or job_nodes(plan.timeout_s, global_sharding=plan.cross_node != "replicate")
    choice = cross_node_choice(plan, nodes) if nodes.node_count > 1 else None
    spread = choice is not None and choice.mode == "global"  # one block per rank; owners on other nodes remote
    if spread and plan.offloads:
        raise ODCConfigError(f"zero_optimization.{' and '.join(plan.offloads)} is not supported with "
                             "zero_optimization.odc.cross_node='global' on several nodes yet (not tested with owners "
                             "on other nodes); use cross_node 'replicate' (the default) for it")
    layout = plan.layout(1 if spread else nodes.node_count)
    transport = create_transport(plan.transport, rank=nodes.local_rank, world_size=nodes.local_world,
                                 timeout_s=plan.timeout_s, device=plan.device, shm_dir=plan.shm_dir,
                                 stripe_numel=plan.stripe_numel, group=nodes.node_group,
                                 first_rank=nodes.first_rank, wording=PROTOCOL_WORDING)
    regions, accumulator_dtype = (2, torch.float64) if plan.exact else (1, plan.accumulator_dtype)
    spec = WindowSpec(layout.window_numel, plan.compute_dtype, regions * layout.accumulator_numel,
                      ODCRuntime.exchange_width(plan.norm_groups), accumulator_dtype)
    failure = None
    try:
        transport.allocate(spec)
    except Exception as err:  # noqa: BLE001 - every node learns of it in the agreement below
        failure = err
    remote = None
    try:
        nodes.agree(failure, "allocating its ODC windows")
        link = nodes.link(plan.timeout_s, transport.heartbeat, global_sharding=spread)
        if spread:
            assert nodes.remote_group is not None
            remote = RemoteWindows(nodes.remote_group, tdist.get_rank(), nodes.topology.world_size, plan.timeout_s,
                                   window=transport.local_param_window,
                                   add_own=lambda offset, grad: transport.accumulate(transport.rank, offset, grad),
                                   cause=link.posted_failure)
    except BaseException:
        transport.close()
        raise
    runtime = ODCRuntime(transport, layout, plan.ledger, on_open=on_open, link=link, exact=plan.exact, remote=remote,
                         job_world=nodes.topology.world_size)
    runtime.cross_node = choice
    return runtime


def cross_node_choice(plan: SessionPlan, nodes: JobNodes) -> CrossNodeChoice:
    """How a job on several nodes holds its windows (``cross_node``; the same on every rank: pure arithmetic
    on the plan). "auto" replicates while the replicated part fits ``node_replica_budget_gb`` and is global
    otherwise: whole-layer replicas beside global shards (the planner's "budget") are not built yet, so
    where only some layers would fit, the job is global and the reason says so."""
    if plan.cross_node == "global" and nodes.remote_group is None:
        raise ODCConfigError("cross_node 'global' without the job's group for pulls across nodes")
    trainable = sum(s.numel for s in plan.trainable)
    frozen = sum(s.numel for s in plan.frozen)
    accumulator = 16 if plan.exact else plan.accumulator_dtype.itemsize
    choice = resolve_cross_node(plan.cross_node, plan.replica_budget_gb, [("model", trainable, frozen)],
                                nodes.node_count, nodes.local_world, plan.compute_dtype.itemsize, accumulator)
    if plan.cross_node == "auto" and choice.mode != "replicate":  # one unit: all or nothing
        states = ModelStates(trainable + frozen, trainable, nodes.local_world, nodes.node_count,
                             plan.compute_dtype.itemsize, accumulator)
        full, shared = states.replicate().total, states.global_sharded().total
        choice = dataclasses.replace(choice, mode="global", replicated_layers=(), bytes_per_rank=shared, reason=(
            f"auto: replicate would hold {_size(full)} of model states per rank, {_size(full - shared)} beyond "
            f"global's {_size(shared)}, over node_replica_budget_gb={plan.replica_budget_gb:g}: global"))
    return choice


def _size(count: float) -> str:
    """Bytes in the largest unit that keeps them above 1 (the log speaks of 70B models and of test models)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"
