"""Owners on other nodes, reached one-sided: ``cross_node: "global"`` on CPU hosts (``docs/multinode.md``).

With global sharding every rank holds only its own ``1/world`` of the windows, so a pull or push whose
owner sits on another node cannot be a load or an add on a mapping: the bytes cross the network. This
module carries them on ``torch.distributed`` point-to-point messages (gloo over TCP), not on a socket
protocol of its own, and keeps the contract of the node transports: the owner's *code* does not take
part. Each rank runs a **server thread** that answers requests for its own windows while its main
thread trains:

* read     ``REQUEST [READ, offset, numel]``  -> ``REPLY`` the window's elements, bytes as they are;
* push     ``REQUEST [PUSH, offset, numel, dtype]`` + ``PAYLOAD`` -> the server adds it into the
  accumulator through the node transport (so under its stripe locks, exactly as a node peer's push),
  then ``REPLY [status]``. A push returns once its acknowledgement arrived: when a rank reaches the
  step's fence every push it sent has landed (the fence's rule, across nodes at no extra cost);
* stop     ``REQUEST [STOP]``: a peer closed; the thread ends once every peer has said so.

Why gloo point-to-point rather than MPI-3 one-sided windows or a store: it is already in every job
(the launchers' rendezvous sets it up), its messages between two ranks keep their order per tag
(several requests to one owner can be in flight, answered in order), a receive can name "any source"
(one thread serves every peer), and a dead peer breaks its connection at once (the waiting rank
raises within milliseconds) while a stalled one is bounded by a receive's timeout.

When the reads and adds happen is the step protocol's business, not this module's: pulls are allowed
only between a publish and the next fence, which are job-wide on this mode
(:class:`~ds_odc.comm.cross_node.GlobalLink`), so no pull sees an owner halfway through its update.
"""
from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from typing import Any, Callable, NoReturn, Optional, Sequence

import torch
import torch.distributed as tdist

from ds_odc.comm.batch import COMPLETED, Completion, Transfer
from ds_odc.comm.failure import CAUSE_GRACE_S, FailureRecord, wait_for_cause
from ds_odc.comm.schedule import point
from ds_odc.errors import ODCPeerError, ODCTimeoutError

REQUEST, PAYLOAD, REPLY = 71, 72, 73  # message tags (the group is this module's own)
READ, PUSH, STOP = 1, 2, 3
HEADER_WIDTH = 4  # op, offset, numel, dtype code
#: Gradient dtypes a push may carry, by code (the code travels in the request's header).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
#: How long closing waits for its stops to be sent (peers that are gone or unreachable need none).
STOP_WAIT_S = 2.0

_log = logging.getLogger("ds_odc")


class RemoteWindows:
    """This rank's reads and pushes to owners on other nodes, and the thread serving its own windows.

    ``group``: a gloo group of every rank of the job (job ranks are its ranks); ``window`` and
    ``add_own``: this rank's parameter window and how to add into its accumulator (the node transport's
    ``accumulate`` on this rank, which takes the stripe locks its node peers take);
    ``cause``: the job's failure record when one was posted (the failure board), to name the origin
    when a request breaks."""

    def __init__(self, group, rank: int, world_size: int, timeout_s: float,
                 window: Callable[[], torch.Tensor], add_own: Callable[[int, torch.Tensor], None],
                 cause: Callable[[], Optional[FailureRecord]] = lambda: None):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.window, self.add_own, self.cause = window, add_own, cause
        # traffic, for tests and metrics: what this rank asked of other nodes, and what it served
        self.reads = self.pushes = self.bytes_read = self.bytes_pushed = 0
        self.served_reads = self.served_pushes = 0
        self.server_error: Optional[BaseException] = None
        self._stops = 0
        self._closed = False
        self._exit_lock = threading.Lock()
        self._on_exit: Optional[Callable[[], None]] = None
        self._ended = False
        self._replies: queue.SimpleQueue = queue.SimpleQueue()  # sends of replies, for _see_replies_leave
        self._replies_lock = threading.Lock()
        self._replies_in_flight = 0
        self._replies_left = 0  # replies the ended server could not see leave (see _drain)
        self._server = threading.Thread(target=self._serve, name=f"ds_odc-remote-server-{rank}", daemon=True)
        self._server.start()

    # -- the client side (this rank's main thread) ---------------------------------------------------
    def read_many(self, reads: Sequence[Transfer], doing: str = "pulling parameters") -> Completion:
        """Every ``transfer.tensor`` filled from ``transfer.owner``'s (a job rank) window at ``offset``.
        Every request is sent before the first reply is awaited; returns when all have arrived."""
        point("remote.pull")
        window = self.window()
        window_dtype, window_numel = window.dtype, window.numel()
        sends: list[tuple[int, Any]] = []
        replies: list[tuple[int, Any, torch.Tensor, torch.Tensor]] = []
        for transfer in reads:
            out = transfer.tensor
            if transfer.offset < 0 or transfer.offset + out.numel() > window_numel:
                # every rank's window has this rank's size (one block each): an owner could not answer it
                raise ValueError(f"a read of {out.numel()} elements at offset {transfer.offset} from rank "
                                 f"{transfer.owner} on another node lies beyond its window ({window_numel} elements)")
            landing = out if out.dtype == window_dtype and out.is_contiguous() else \
                torch.empty(out.numel(), dtype=window_dtype)
            header = torch.tensor([READ, transfer.offset, out.numel(), 0], dtype=torch.int64)
            sends.append((transfer.owner, self._issue(tdist.isend, header, transfer.owner, REQUEST, doing)))
            replies.append((transfer.owner, self._issue(tdist.irecv, landing, transfer.owner, REPLY, doing),
                            landing, out))
            self.reads += 1
            self.bytes_read += out.numel() * landing.element_size()
        for owner, work in sends:
            self._wait(work, owner, doing)
        for owner, work, landing, out in replies:
            self._wait(work, owner, doing)
            if landing is not out:
                out.copy_(landing.view(out.shape))
        return COMPLETED

    def accumulate_many(self, pushes: Sequence[Transfer], doing: str = "pushing gradients") -> Completion:
        """Every ``transfer.tensor`` added into ``transfer.owner``'s accumulator at ``offset``; returns
        once every owner acknowledged its add (the pushes have landed)."""
        point("remote.push")
        sends: list[tuple[int, Any]] = []
        replies: list[tuple[int, Any, torch.Tensor]] = []
        for transfer in pushes:
            payload = transfer.tensor.detach().reshape(-1).contiguous().cpu()
            if payload.dtype not in DTYPES:
                raise ValueError(f"a push of dtype {payload.dtype} cannot cross nodes (one of {DTYPES})")
            header = torch.tensor([PUSH, transfer.offset, payload.numel(), DTYPES.index(payload.dtype)],
                                  dtype=torch.int64)
            status = torch.zeros(1, dtype=torch.int64)
            sends.append((transfer.owner, self._issue(tdist.isend, header, transfer.owner, REQUEST, doing)))
            sends.append((transfer.owner, self._issue(tdist.isend, payload, transfer.owner, PAYLOAD, doing)))
            replies.append((transfer.owner, self._issue(tdist.irecv, status, transfer.owner, REPLY, doing), status))
            self.pushes += 1
            self.bytes_pushed += payload.numel() * payload.element_size()
        for owner, work in sends:
            self._wait(work, owner, doing)
        for owner, work, status in replies:
            self._wait(work, owner, doing)
            if int(status[0]) != 0:
                raise ODCPeerError(f"rank {owner} could not add a gradient pushed by rank {self.rank} into its "
                                   f"accumulator (its error is in its log); rank {self.rank} was {doing}", None)
        return COMPLETED

    def _issue(self, start: Callable, tensor: torch.Tensor, owner: int, tag: int, doing: str):
        """Start one message (``tdist.isend`` / ``tdist.irecv``). gloo refuses a message on a connection it
        already knows closed as it is issued, before any wait: that is the same broken peer as a wait that
        fails, and raises the same error."""
        try:
            return start(tensor, owner, group=self.group, tag=tag)
        except Exception as err:  # noqa: BLE001 - a peer's failure is the better explanation
            self._broken(err, owner, doing)

    def _wait(self, work, owner: int, doing: str) -> None:
        """One message, bounded by ``timeout_s``; a broken one names the job's failure if one was posted."""
        try:
            work.wait(self.timeout)
        except Exception as err:  # noqa: BLE001 - a peer's failure is the better explanation
            self._broken(err, owner, doing)

    def _broken(self, err: Exception, owner: int, doing: str) -> NoReturn:
        """Raise for a message to ``owner`` that failed: naming the job's failure if one is posted within the
        grace, else the owner and what gloo said."""
        record = wait_for_cause(self.cause, min(CAUSE_GRACE_S, self.timeout_s))
        if record is not None:
            raise ODCPeerError(f"{record.describe()}; rank {self.rank} was {doing} (owner: rank {owner} on "
                               "another node)", record) from err
        if "Timed out" in str(err) or "timed out" in str(err):
            raise ODCTimeoutError(f"rank {self.rank} waited {self.timeout_s:.0f}s for rank {owner} on another "
                                  f"node while {doing}: it is stuck or its node is unreachable "
                                  "(zero_optimization.odc.timeout_s)", None) from err
        raise ODCPeerError(f"rank {self.rank} lost rank {owner} on another node while {doing}: {err}",
                           None) from err

    # -- the server side (a thread of this rank) -------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._answer_requests()
        finally:
            with self._exit_lock:
                self._ended = True
                on_exit, self._on_exit = self._on_exit, None
            if on_exit is not None and not self._replies_left:
                on_exit()

    def _answer_requests(self) -> None:
        """Serve requests until every peer has said STOP. Replies are sent without waiting for them to leave
        (:meth:`_see_replies_leave` waits for them, on a thread of its own): a requester that stops reading
        (stalled mid-pull, its socket full) holds up only its own replies, and this thread goes on serving the
        others. A reply is a view of the window: the protocol keeps it unchanged until the requester has it (an
        owner updates only after every rank's fence, which a requester reaches only with its replies in hand)."""
        header = torch.zeros(HEADER_WIDTH, dtype=torch.int64)
        leaving = threading.Thread(target=self._see_replies_leave, name=f"ds_odc-remote-replies-{self.rank}",
                                   daemon=True)
        leaving.start()
        try:
            self._serve_until_stopped(header)
        finally:
            self._drain()

    def _send_reply(self, tensor: torch.Tensor, requester: int) -> None:
        sending = tdist.isend(tensor, requester, group=self.group, tag=REPLY)  # raises if that requester is gone
        with self._replies_lock:
            self._replies_in_flight += 1
        self._replies.put(sending)

    def _see_replies_leave(self) -> None:
        """Wait for each reply to leave, in the order they were sent. Never with a timeout: on a timeout gloo
        fails every connection of the group (a reply still streaming to a requester would end the job). A
        reply to a requester that is gone fails at once; one to a stuck requester waits here (a daemon thread)
        until the group's own timeout."""
        while True:
            work = self._replies.get()
            if work is None:
                return
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - that requester is gone: its reply need not leave
                pass
            with self._replies_lock:
                self._replies_in_flight -= 1

    def _drain(self) -> None:
        """Wait (bounded) for the replies still on their way: they read the window, which must stay mapped until
        they have left. Every requester that said STOP had its replies; one left over is to a requester that
        stopped reading and never said STOP (it is stuck; its node names it). Such a reply keeps the windows:
        ``_replies_left`` tells :meth:`close` and :meth:`after_serving` not to free them (they go with the
        process; the shared-memory files are unlinked at start-up already)."""
        deadline = time.monotonic() + min(STOP_WAIT_S, self.timeout_s)
        while self._replies_in_flight and time.monotonic() < deadline:
            time.sleep(0.005)
        self._replies_left = self._replies_in_flight
        self._replies.put(None)  # the waiting thread ends after the replies before it

    def _serve_until_stopped(self, header: torch.Tensor) -> None:
        while self._stops < self.world_size - 1:
            try:
                source = tdist.recv(header, None, group=self.group, tag=REQUEST)
            except Exception as err:  # noqa: BLE001 - the group is gone (the process is ending)
                self.server_error = err
                return
            op, offset, numel, code = (int(v) for v in header.tolist())
            try:
                if op == READ:
                    self._send_reply(self.window().narrow(0, offset, numel), source)
                    self.served_reads += 1
                elif op == PUSH:
                    self._serve_push(source, offset, numel, DTYPES[code])
                elif op == STOP:
                    self._stops += 1
            except Exception as err:  # noqa: BLE001 - that requester raises; this thread serves the others
                self.server_error = err
                _log.error(f"ds_odc: rank {self.rank} could not serve rank {source}'s request {header.tolist()}: "
                           f"{type(err).__name__}: {err}")

    def _serve_push(self, source: int, offset: int, numel: int, dtype: torch.dtype) -> None:
        """Receive a push's payload (bounded: a pusher stalled between its header and its payload must not stop
        this thread; on that timeout gloo fails the group's connections, which ends the job as a stalled rank
        does anyway), add it, and send the status."""
        payload = torch.empty(numel, dtype=dtype)
        try:
            arriving = tdist.irecv(payload, source, group=self.group, tag=PAYLOAD)
            assert arriving is not None  # a member of the group (every rank of the job is)
            arriving.wait(self.timeout)
        except Exception as err:  # noqa: BLE001 - that pusher is stuck or gone: its own node names it
            self.server_error = err
            _log.error(f"ds_odc: rank {self.rank} gave up on the payload of rank {source}'s push after "
                       f"{self.timeout_s:.0f}s: {type(err).__name__}: {err}")
            return
        status = 0
        try:
            self.add_own(offset, payload)
            self.served_pushes += 1
        except Exception as err:  # noqa: BLE001 - reported to the pusher, which fails its group
            status = 1
            self.server_error = err
            _log.error(f"ds_odc: rank {self.rank} could not add rank {source}'s push: {type(err).__name__}: {err}")
        self._send_reply(torch.tensor([status], dtype=torch.int64), source)

    @property
    def serving(self) -> bool:
        return self._server.is_alive()

    def after_serving(self, release: Callable[[], None]) -> None:
        """Call ``release`` (what frees the windows this thread reads and adds into) once the server has
        ended: at once if it has; never if a reply of it may still read them (see :meth:`_drain`)."""
        with self._exit_lock:
            if not self._ended:
                self._on_exit = release
                return
        if not self._replies_left:
            release()

    def close(self, wait_s: float = 0.0) -> bool:
        """Tell every peer's server that this rank sends no more requests. This rank's own server ends
        once every peer has said the same (it still answers peers that are not done); ``wait_s``: how
        long to wait for that here. Returns whether it has ended with every reply gone (then nothing reads the
        windows any more); if not, the thread is a daemon and ends by itself when the last peer closes. Idempotent."""
        if self._closed:
            return self._done()
        self._closed = True
        stop = torch.tensor([STOP, 0, 0, 0], dtype=torch.int64)
        sends: list[Any] = []
        for peer in range(self.world_size):
            if peer != self.rank:
                try:
                    sends.append(tdist.isend(stop, peer, group=self.group, tag=REQUEST))
                except Exception:  # noqa: BLE001 - that peer is gone: it needs no stop
                    pass
        deadline = time.monotonic() + min(STOP_WAIT_S, self.timeout_s)  # one bound for all: a cut link must not
        for work in sends:                                                # cost it once per peer
            try:
                work.wait(datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
            except Exception:  # noqa: BLE001 - that peer is gone or unreachable: it needs no stop
                pass
        if wait_s > 0:
            self._server.join(wait_s)
        return self._done()

    def _done(self) -> bool:
        """The server has ended and no reply of it still reads the windows."""
        return not self._server.is_alive() and not self._replies_left

