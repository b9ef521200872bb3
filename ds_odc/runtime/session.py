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

from ds_odc.comm import WindowSpec, create_transport
from ds_odc.comm.nodes import JobNodes, job_nodes
from ds_odc.runtime.core import ODCRuntime
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
    nodes = nodes or job_nodes(plan.timeout_s)
    layout = plan.layout(nodes.node_count)
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
    try:
        nodes.agree(failure, "allocating its ODC windows")
        link = nodes.link(plan.timeout_s, transport.heartbeat)
    except BaseException:
        transport.close()
        raise
    return ODCRuntime(transport, layout, plan.ledger, on_open=on_open, link=link, exact=plan.exact)
