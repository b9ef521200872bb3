"""Between nodes, one exchange per step (``docs/multinode.md``): the cross-node link.

Inside a node, the ranks' windows and accumulators hold every shard of the job between them, one
block per node (:class:`NodeBlocks`; the layout math is in :mod:`ds_odc.runtime.layout`): local rank
``l`` holds the blocks of the ranks with local rank ``l`` on every node, its ``cross_group``. Pulls
and pushes stay inside the node. At the step, after the node's fence, each cross group (one rank per
node, in node order) runs:

1. :meth:`TorchDistributedLink.job_rows`: the node's fence rows (micro-batch and token counts of each
   rank), gathered into the job's rows, so that normalisation sees every node's micro-batches;
2. :meth:`TorchDistributedLink.reduce_gradients`: a reduce-scatter of the accumulator's blocks, after
   which this rank's own block holds the job's sum of its ZeRO-3 partition (its ``1/world``: where
   its fp32 master weights and optimizer state live, as in ZeRO-3), and the other blocks are zero;
3. :meth:`TorchDistributedLink.job_sum`: the node's squared-norm partials summed over the nodes;
4. (the caller updates its own block);
5. :meth:`TorchDistributedLink.gather_windows`: an all-gather of every rank's updated block, bytes as
   they are, into the window.

Four collectives per step, on ``torch.distributed`` (gloo on CPU, NCCL on GPU), whatever the number of
layers, parameters and micro-batches. Outside a step: the windows are gathered after their owners
rewrote them (the open round, a checkpoint load), a gradient read first sums the accumulators, and
a barrier (checkpoint save) is the node's round, then :meth:`TorchDistributedLink.barrier`. Every wait
in them is bounded and watches the job's :class:`FailureBoard`, so a rank that fails (or sees a
node peer die) on one node makes the ranks of every other node raise naming it, instead of waiting
out a collective that will never complete.
:class:`CrossNodeLink` is the interface, and the link of a job on one node: nothing to exchange.
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as tdist

from ds_odc.comm.backoff import wait_until
from ds_odc.comm.failure import CAUSE_GRACE_S, FailureKind, FailureRecord, wait_for_cause
from ds_odc.errors import ODCPeerError, ODCTimeoutError

#: The longest a call to the job's store may take before the store counts as unreachable.
STORE_CALL_BOUND_S = 10.0
#: How often a rank waiting in the exchange reads the board (and beats its heartbeat).
BOARD_PERIOD_S = 0.05


@dataclass(frozen=True)
class NodeBlocks:
    """Where each node's block sits in a rank's window and accumulator: ``node_count`` trainable blocks
    of ``trainable_numel`` elements first (contiguous: one tensor for the step's collectives), then
    ``node_count`` frozen blocks of ``frozen_numel`` (windows only).

    >>> blocks = NodeBlocks(node_count=2, trainable_numel=3, frozen_numel=2)
    >>> blocks.trainable(1), blocks.frozen(0), blocks.frozen(1)
    ((3, 3), (6, 2), (8, 2))
    """

    node_count: int
    trainable_numel: int
    frozen_numel: int

    def trainable(self, node: int) -> tuple[int, int]:
        """``(offset, numel)`` of ``node``'s trainable block, in the window and in the accumulator."""
        return node * self.trainable_numel, self.trainable_numel

    def frozen(self, node: int) -> tuple[int, int]:
        """``(offset, numel)`` of ``node``'s frozen block in the window."""
        return self.node_count * self.trainable_numel + node * self.frozen_numel, self.frozen_numel


class CrossNodeLink:
    """What the step exchanges with the other nodes. This base is the link of a job on one node: the
    node's rounds already see the whole job, so every method passes its input through."""

    node_count = 1
    node = 0
    collectives = 0

    def job_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def job_sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def reduce_gradients(self, accumulator: torch.Tensor, blocks: NodeBlocks) -> None:
        pass

    def gather_windows(self, window: torch.Tensor, blocks: NodeBlocks, frozen: bool = False) -> None:
        pass

    def barrier(self, what: str) -> None:
        pass

    def settle(self, what: str) -> None:
        """Every node's ranks have reached this point: nothing on one node, or where pushes stay in the
        node (replicate); a barrier of the job where pushes cross nodes (:class:`GlobalLink`)."""

    def announce(self, record: FailureRecord) -> None:
        pass

    def posted_failure(self) -> Optional[FailureRecord]:
        """The job's failure another node posted, or None (one node: its rounds say it)."""
        return None

    def close(self) -> None:
        pass


class FailureBoard:
    """The job's first failure, where every node can read it: a key in the job's key-value store
    (the ``torch.distributed`` rendezvous store, reachable from every node).

    A node's ranks learn of each other's failures from their shared control blocks; the board carries
    one of them to the other nodes, whose ranks may be waiting in a cross-node collective for a rank
    that will never join it."""

    def __init__(self, store, key: str, timeout_s: float = STORE_CALL_BOUND_S):
        self.store, self.key = store, key
        self.timeout_s = min(timeout_s, STORE_CALL_BOUND_S)
        self.unreachable: Optional[str] = None  # why the store stopped answering, once it has

    def post(self, record: FailureRecord) -> None:
        def post() -> None:
            if not self.store.check([self.key]):
                self.store.set(self.key, record.encode())
        try:
            self._bounded(post)
        except Exception:  # noqa: BLE001 - the store's host is gone: the others find out by themselves
            pass

    def read(self) -> Optional[FailureRecord]:
        """The posted failure, or None. Raises ODCPeerError if the store itself cannot be reached
        (its host, node 0's, is gone, or the network to it is cut)."""
        def read() -> Optional[bytes]:
            return self.store.get(self.key) if self.store.check([self.key]) else None
        try:
            raw = self._bounded(read)
        except Exception as err:  # noqa: BLE001
            raise ODCPeerError(f"the job's store (on node 0) cannot be reached: node 0 or its rank 0 is gone, or the "
                               f"network to it is cut ({err})", None) from err
        return None if raw is None else FailureRecord.decode(raw)

    def _bounded(self, call: Callable[[], Any]) -> Any:
        """``call`` (a store round trip) within ``timeout_s``. A store client waits on its socket without a
        bound when the network to the store's host is cut (no reset ever comes), so the call runs on a helper
        thread; one that does not return leaves the board unreachable for good (that thread stays blocked,
        a daemon, until the process ends: the job is failing by then)."""
        if self.unreachable is not None:
            raise ConnectionError(self.unreachable)
        outcome: list = []

        def run() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                outcome.append((False, err))

        helper = threading.Thread(target=run, daemon=True, name="ds_odc-store-call")
        helper.start()
        helper.join(self.timeout_s)
        if not outcome:
            self.unreachable = f"no answer from the store within {self.timeout_s:.0f}s"
            raise ConnectionError(self.unreachable)
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Drop this rank's connection to the store (``engine.destroy()``)."""
        store, self.store = self.store, None
        del store  # a TCPStore client closes its socket when released


class TorchDistributedLink(CrossNodeLink):
    """The step's collectives between nodes, for one rank, on ``torch.distributed`` (see the module
    docstring).

    ``cross_group``: this rank's cross-node group, one rank per node in node order (this rank is the
    ``node``-th); ``board``: where failures are posted; ``timeout_s``: how long a collective may wait
    for the other nodes; ``rank``: this rank in the job; ``heartbeat``: called while waiting (the
    node's rounds watch progress)."""

    def __init__(self, cross_group, board: FailureBoard, timeout_s: float, rank: int,
                 heartbeat: Callable[[], None] = lambda: None):
        self.cross_group, self.board = cross_group, board
        self.heartbeat = heartbeat  # node peers waiting for this rank at a round must see it alive
        self.node_count = tdist.get_world_size(cross_group)
        self.node = tdist.get_rank(cross_group)
        self.timeout_s, self.rank = timeout_s, rank
        self.blocking_waits = tdist.get_backend(cross_group) == "gloo"
        # counts and norms are host tensors; NCCL takes only device ones
        self.small_device = (torch.device("cpu") if self.blocking_waits
                             else torch.device("cuda", torch.cuda.current_device()))
        self.collectives = 0  # issued so far: a test counts them per step

    def job_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every node's ``rows`` (one per local rank), stacked in node order: one row per job rank."""
        rows = rows.to(self.small_device).contiguous()
        out = torch.empty((self.node_count * rows.shape[0],) + tuple(rows.shape[1:]), dtype=rows.dtype,
                          device=self.small_device)
        self._run(lambda: tdist.all_gather_into_tensor(out, rows, group=self.cross_group, async_op=True),
                  "gathering every node's micro-batch counts")
        return out.cpu()

    def job_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the nodes (each node contributes its node-wide partial)."""
        total = values.to(self.small_device, copy=True)
        self._run(lambda: tdist.all_reduce(total, group=self.cross_group, async_op=True),
                  "summing the gradient norm over nodes")
        return total.cpu()

    def reduce_gradients(self, accumulator: torch.Tensor, blocks: NodeBlocks) -> None:
        """Sum every node's accumulator blocks: this rank's own block becomes the job's sum for its
        partition, the others zero (so calling it again, after more pushes, stays exact)."""
        offset, numel = blocks.trainable(0)
        every_block = accumulator.narrow(0, offset, numel * self.node_count)
        mine = torch.empty(numel, dtype=accumulator.dtype, device=accumulator.device)
        self._run(lambda: tdist.reduce_scatter_tensor(mine, every_block, group=self.cross_group, async_op=True),
                  "summing gradients over nodes")
        accumulator.zero_()
        accumulator.narrow(0, *blocks.trainable(self.node)).copy_(mine)

    def gather_windows(self, window: torch.Tensor, blocks: NodeBlocks, frozen: bool = False) -> None:
        """Copy every node's own trainable block (and with ``frozen``, frozen block) into this rank's
        window, bytes as they are (no collective arithmetic on the compute dtype)."""
        if blocks.node_count != self.node_count:
            raise ValueError(f"cross-node group of {self.node_count} ranks for {blocks.node_count} node blocks")
        regions = [blocks.trainable] + ([blocks.frozen] if frozen else [])
        for block in regions:
            offset, numel = block(0)
            if numel == 0:
                continue
            everything = window.narrow(0, offset, numel * self.node_count).view(torch.uint8)
            mine = window.narrow(0, *block(self.node)).view(torch.uint8).clone()
            self._run(functools.partial(tdist.all_gather_into_tensor, everything, mine, group=self.cross_group,
                                        async_op=True), "gathering updated shards from every node")

    def barrier(self, what: str) -> None:
        """After the node's own round (every rank of this node has arrived): every node's has too."""
        flag = torch.zeros(1, device=self.small_device)
        self._run(lambda: tdist.all_reduce(flag, group=self.cross_group, async_op=True),
                  f"waiting for the other nodes at {what}")

    def announce(self, record: FailureRecord) -> None:
        """This node's ranks cannot continue: tell every node."""
        self.board.post(record)

    def posted_failure(self) -> Optional[FailureRecord]:
        return self.board.read()

    def close(self) -> None:
        self.board.close()

    def _run(self, start: Callable[[], Any], doing: str) -> None:
        """Issue a collective (``start()``, an async op) and wait for it, watching the board; bounded by
        ``timeout_s``. Issued here, not by the caller: gloo refuses a collective on a connection it already knows
        closed as it is issued, and that is the same broken peer as a wait that fails.

        gloo runs some collectives (reduce-scatter) inside ``wait()`` and never reports them complete
        before, so on gloo a helper thread waits and this thread watches it. If the exchange fails,
        that thread stays blocked until the group's own timeout ends the collective (timeout_s plus a
        minute); the engine is failed by then. On NCCL, ``wait()`` only orders the current stream
        after the collective, so the collective's completion is polled instead.

        The board (a round trip to the store) is read every ``BOARD_PERIOD_S``, not at every poll: the
        store's host is one of the ranks, and its neighbours on a busy node would feel the traffic."""
        self.collectives += 1
        deadline = time.monotonic() + self.timeout_s
        try:
            work = start()
        except Exception as err:  # noqa: BLE001 - gloo refuses a collective on a connection it knows closed
            self._broken(err, doing)
        if self.blocking_waits:
            outcome: list = []
            waiter = threading.Thread(target=_wait_into, args=(work, outcome), daemon=True,
                                      name="ds_odc-cross-node-wait")
            waiter.start()

            def finished(within: float) -> bool:
                waiter.join(within)  # returns as soon as the collective does
                return not waiter.is_alive()
        else:
            def finished(within: float) -> bool:
                return wait_until(work.is_completed, within, first_s=1e-5)
        while not finished(BOARD_PERIOD_S):
            record = self.board.read()
            if record is not None:
                raise ODCPeerError(f"{record.describe()}; rank {self.rank} was {doing}", record)
            if time.monotonic() > deadline:
                self._timed_out(doing)
            self.heartbeat()
        try:
            if not self.blocking_waits:
                work.wait()
            elif outcome:
                raise outcome[0]
        except Exception as err:  # noqa: BLE001 - a peer's failure is the better explanation
            self._broken(err, doing)

    def _broken(self, err: Exception, doing: str) -> NoReturn:
        """Raise for a collective that failed, as it was issued or while awaited: naming the rank the board
        names, if one is posted within the grace, else the loss of the other nodes and what gloo said."""
        record = self._cause(min(CAUSE_GRACE_S, self.timeout_s))
        if record is not None:
            raise ODCPeerError(f"{record.describe()}; rank {self.rank} was {doing}", record) from err
        raise ODCPeerError(f"rank {self.rank} lost the other nodes while {doing}: {err}", None) from err

    def _timed_out(self, doing: str) -> NoReturn:
        """Raise for a collective that waited ``timeout_s``: naming the rank the board names, if one is posted
        within the grace, else only the wait.

        A rank stalled inside the step (SIGSTOP, a hang) is found by its own node's rounds ``timeout_s`` after
        its last progress, and its partner here waits ``timeout_s`` from entering the collective: both run out at
        about the same moment, so without waiting for the board its partner raised naming no one about half the
        time (reproduced in tests/distributed/test_exchange.py, a stall posted 0.5 s after the timeout). The bound
        is then ``timeout_s`` plus ``min(CAUSE_GRACE_S, timeout_s)``, as for a collective broken by a peer."""
        record = self._cause(min(CAUSE_GRACE_S, self.timeout_s))
        if record is not None:
            raise ODCPeerError(f"{record.describe()}; rank {self.rank} was {doing}", record)
        record = FailureRecord(self.rank, 0, doing, f"waited {self.timeout_s:.0f}s for the other nodes' ranks "
                               f"of its cross-node group", FailureKind.STALLED)
        raise ODCTimeoutError(f"rank {self.rank} waited {self.timeout_s:.0f}s for the other nodes while "
                              f"{doing}: a rank there is stuck or its node is gone "
                              "(zero_optimization.odc.timeout_s)", record)

    def _cause(self, grace_s: float) -> Optional[FailureRecord]:
        """The board's record, waiting up to ``grace_s`` for it (:func:`~ds_odc.comm.failure.wait_for_cause`),
        beating this rank's heartbeat meanwhile."""
        return wait_for_cause(self.board.read, grace_s, self.heartbeat)


class GlobalLink(TorchDistributedLink):
    """The link of ``cross_node: "global"``: every rank holds only its own block, pulls and pushes reach
    owners on other nodes one-sided (:mod:`ds_odc.comm.remote`), so the step moves no gradients or shards
    between nodes. What stays are the counts and the norm (as with replicate), and barriers where the
    replicated layout's collectives ordered the job: after the updates (no pull before every owner has
    updated), after windows are rewritten or first opened, and before an accumulator is read or zeroed
    outside a step (every push sent to it has landed)."""

    def reduce_gradients(self, accumulator: torch.Tensor, blocks: NodeBlocks) -> None:
        """Every rank's pushes have landed in their owners' accumulators (pushes return acknowledged, so
        every rank being past its fence is enough): nothing to sum."""
        self.barrier("the gradient fence")

    def gather_windows(self, window: torch.Tensor, blocks: NodeBlocks, frozen: bool = False) -> None:
        """Every owner's shards are written (updated, loaded or opened): remote pulls may begin."""
        self.barrier("publishing updated shards")

    def settle(self, what: str) -> None:
        self.barrier(what)


def _wait_into(work, outcome: list) -> None:
    try:
        work.wait()
    except Exception as err:  # noqa: BLE001 - handed to the watching thread
        outcome.append(err)
