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

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as tdist

from ds_odc.comm import WindowSpec, create_transport
from ds_odc.comm.nodes import JobNodes, job_nodes
from ds_odc.comm.remote import RemoteWindows
from ds_odc.comm.schedule import perturb_from_environment
from ds_odc.runtime.core import ODCRuntime
from ds_odc.runtime.cross_node_plan import (
    CrossNodeChoice,
    Layer,
    offloads_with_global_sharding,
    resolve_cross_node,
)
from ds_odc.runtime.layout import WindowLayout
from ds_odc.runtime.ledger import MicroBatchLedger
from ds_odc.runtime.replica_layout import BudgetLayout, group_layers
from ds_odc.runtime.round_kinds import PROTOCOL_WORDING


@dataclass(frozen=True)
class Shard:
    """One parameter as the windows see it: its key, full size, and the (padded) size each owner holds."""

    key: int
    numel: int
    shard_numel: int
    #: the parameter's name in the module (cross_node "budget" groups parameters into layers by it); may be empty
    name: str = ""


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
    #: zero_optimization.odc.cross_node ("replicate", "global", "budget", "auto") and node_replica_budget_gb
    cross_node: str = "replicate"
    replica_budget_gb: Optional[float] = None
    #: ZeRO offloads in use ("offload_param", "offload_optimizer"): not yet tested with owners on other nodes
    offloads: tuple = ()

    def layout(self, node_count: int, choice: Optional[CrossNodeChoice] = None) -> WindowLayout:
        """The window layout: ``node_count`` blocks (replicate), or for a ``choice`` of "budget" global sharding's
        own block plus replica slots for the chosen layers' parameters."""
        budget = choice is not None and choice.mode == "budget"
        layout = BudgetLayout(node_count) if budget else WindowLayout(node_count)
        for shard in self.trainable:
            layout.add_trainable(shard.key, shard.numel, shard.shard_numel)
        for shard in self.frozen:
            layout.add_frozen(shard.key, shard.numel, shard.shard_numel)
        if isinstance(layout, BudgetLayout) and choice is not None:
            _, members = self.layers()
            layout.replicate({key for name in choice.replicated_layers for key in members[name]})
        return layout

    def layers(self) -> tuple[list[Layer], dict[str, tuple[int, ...]]]:
        """The model's layers in forward order, as the planner takes them, and each layer's keys
        (:func:`~ds_odc.runtime.replica_layout.group_layers`)."""
        return group_layers([(s.key, s.name, s.numel, True) for s in self.trainable]
                            + [(s.key, s.name, s.numel, False) for s in self.frozen])


def open_session(plan: SessionPlan, on_open: Optional[Callable[[], None]] = None,
                 nodes: Optional[JobNodes] = None,
                 on_gradients_moved: Optional[Callable[[], None]] = None) -> ODCRuntime:
    """Start ODC on every rank (collective; see the module docstring). ``on_open``: the open round's
    hook (publish shards written since). ``nodes``: the job's nodes when the caller found them already.
    ``on_gradients_moved``: called when a gradient read's copy ends (the adapter points its gradient views at
    :meth:`~ds_odc.runtime.core.ODCRuntime.own_gradients` again; [Note: reads are snapshots])."""
    perturb_from_environment(tdist.get_rank() if tdist.is_initialized() else 0)  # opt-in, for test runs
    nodes = nodes or job_nodes(plan.timeout_s)
    choice = cross_node_choice(plan, nodes) if nodes.node_count > 1 else None
    mode = "replicate" if choice is None else choice.mode
    spread = mode != "replicate"  # one own block per rank; owners on other nodes remote (budget: but replicas)
    if spread and plan.offloads:
        raise offloads_with_global_sharding(plan.offloads, mode)
    layout = plan.layout(1 if mode == "global" else nodes.node_count, choice)
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
        link = nodes.link(plan.timeout_s, transport.heartbeat, mode)
        if spread:
            remote = RemoteWindows(nodes.open_remote_group(), tdist.get_rank(), nodes.topology.world_size,
                                   plan.timeout_s,
                                   window=transport.local_param_window,
                                   add_own=lambda offset, grad: transport.accumulate(transport.rank, offset, grad),
                                   cause=link.posted_failure)
    except BaseException:
        transport.close()
        raise
    runtime = ODCRuntime(transport, layout, plan.ledger, on_open=on_open, link=link, exact=plan.exact, remote=remote,
                         job_world=nodes.topology.world_size, on_gradients_moved=on_gradients_moved)
    runtime.cross_node = choice
    return runtime


def cross_node_choice(plan: SessionPlan, nodes: JobNodes) -> CrossNodeChoice:
    """How a job on several nodes holds its windows (``cross_node``; the same on every rank: pure arithmetic
    on the plan's shapes and names): the planner (:func:`~ds_odc.runtime.cross_node_plan.resolve_cross_node`)
    over the model's layers (:meth:`SessionPlan.layers`), with the accumulator's bytes per element (16 under
    exact sums: two fp64 regions)."""
    accumulator = 16 if plan.exact else plan.accumulator_dtype.itemsize
    layers, _ = plan.layers()
    return resolve_cross_node(plan.cross_node, plan.replica_budget_gb, layers, nodes.node_count, nodes.local_world,
                              plan.compute_dtype.itemsize, accumulator,
                              sharding=torch.device(plan.device).type == "cpu")
