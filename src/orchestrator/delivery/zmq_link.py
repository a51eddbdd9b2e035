"""The ZMQ link between orchestrator and trainer, orchestrator side: batches one way; reports and checkpoints back.

``BatchSender`` binds a ROUTER socket for batches at ``address`` and a PULL socket for the trainers' messages
(``address`` + ``.ckpt`` for ipc, port + 1 for tcp). Trainers (``receiver.BatchReceiver``) connect a DEALER
whose routing id is their ``id``, and name themselves by that id in every message they send back, so the
sender feeds exactly one trainer (``seat.TrainerSeat``): the first to report; another one is refused while
it is connected (two trainers on one address would split the steps between them), and takes over once its
connection is gone (a restarted trainer). Only the holder's acknowledgements and checkpoints count.

Every step is sent once and in order (a step that is not the next one is refused) and kept until the trainer
acknowledges it: at most ``hwm`` steps are unacknowledged, and ``send`` waits (warning every ``warn_s``)
while that many are, so an absent or slow trainer back-pressures the pipeline and memory stays bounded by
``hwm`` batches (plus ``keep`` acknowledged ones). A trainer that takes the seat says which step it holds and
gets every kept step after it again; one behind what was acknowledged (its checkpoint older than its
acknowledgements) gets the ``keep`` acknowledged steps it lacks, or is refused with the steps it lacks when
they are gone. After a restart (``require_report=True``) the sender waits for the trainer's report before
sending anything and skips the steps the trainer already has; ``acked_before`` (the state's acknowledged
step) tells a trainer that is behind it apart. ``checkpoint_wanted`` asks the holder for its newest checkpoint
(a control message; the receiver answers with its status).

``announcements()`` yields the checkpoints the trainer announces (step and weights path), over ZMQ or as
marker files (``step_<N>.ready``) in a directory. With ``shm_bytes`` (same node, ipc:// only) the columns go
through a shared-memory pool of that size (``orchestrator.delivery.shm``) and the ZMQ message is the header
alone; a step's span is freed when the trainer acknowledges (releases) it. With ``server_keys`` both sockets
are CURVE servers (``orchestrator.security``): only trainers whose public keys are authorized connect, and the
traffic is encrypted; an unauthorized peer receives nothing and its messages never arrive.

The direct data plane (docs/data-plane.md): ``send`` takes a step manifest
(``contracts.manifest.StepManifest``) instead of a batch: one frame, the same window, order, resend and
acknowledgement rules; the columns stay in the env workers' pools, which the trainer maps. ``announce_pool``
tells the trainer about a worker's pool as soon as the worker announces it (``{"ctl": "pool", ...}``; again to
every trainer that takes the seat), so the trainer maps it before a step needs it: a worker that dies later
loses nothing the trainer mapped. An announcement a full queue cannot take now is not retried: the manifest
names every pool it needs anyway. A trainer that cannot map some pools of a step reports it lost
(``{"lost": N, "attempt": A, "pools": [...]}`` in its status messages): ``lost_steps()`` yields those reports,
and ``replace(manifest)`` sends the rebuilt attempt of step N, then the steps after it again.

Weights over the wire (contracts/transfer.py): ``tell_transfer`` sends the trainer holding the seat a transfer
request (``{"ctl": "transfer", ...}``), ``transfer_event`` waits for its answers, ``broadcast_offer`` says which
backends it can send weights with (its status messages say it), ``trainer_connected`` whether its connection is
still there (a trainer that died mid-broadcast is named by it).

Trainer -> orchestrator messages (msgpack maps): ``{"have": N, "id": ID, "name": NAME}`` (acknowledges every
step <= N; -1 for none), with ``"hello": true`` when a receiver starts, and ``"checkpoint": K, "path": P``
(the newest weights it announced or resumed from) when it has one. Orchestrator -> trainer: batches
(``wire.encode``), and control messages ``[b"ctl", msgpack map]``: ``{"ctl": "refused", "why": ...}``,
``{"ctl": "checkpoint", "min": N}``, ``{"ctl": "ping"}``, ``{"ctl": "pool", "worker", "id", "size", "host",
"path"}``, ``{"ctl": "end"}`` (``run_finished``: the run trained its last step and will ask nothing more). See
docs/wire-format.md; contracts/reports.py decodes the trainer's messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from orchestrator import ipc
from orchestrator.background import background
from orchestrator.contracts.checkpoints import Checkpoint, CheckpointFeed, marker_announcements
from orchestrator.contracts.link import CONTROL, ckpt_address
from orchestrator.contracts.manifest import StepManifest, encode_manifest
from orchestrator.contracts.reports import LostStep, TrainerReport, decode_report
from orchestrator.contracts.transfer import TransferEvent, TransferRequest, request_message
from orchestrator.contracts.wire import Batch, encode
from orchestrator.delivery.seat import Peer, TrainerSeat, Verdict
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.shm import ShmPool, pool_socket_path, serve_pool
from orchestrator.errors import TransportError, WireError
from orchestrator.security import ServerKeys, curve_server

log = logging.getLogger(__name__)

SEAT_GRACE_S = 2.0  # a second trainer is refused if the first is still connected this long after it appeared
TRANSFER_EVENTS = 64  # transfer answers queued unread; more are dropped (warned): they answer nothing asked


def _bind_pair(out: zmq.asyncio.Socket, pull: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``out`` (the batch socket) at ``address`` and ``pull`` at its ``ckpt_address``; the address ``out``
    got. A tcp:// port of ``*`` or 0 asks for any free pair: when the port after the one ``out`` got is taken,
    another is tried (as the prime-rl sender does), so a busy host's other sockets do not fail the bind."""
    tries = 20 if address.startswith("tcp://") and address.rpartition(":")[2] in ("*", "0") else 1
    while True:
        out.bind(address)
        bound = out.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when address asked for any
        try:
            pull.bind(ckpt_address(bound))
            return bound
        except zmq.ZMQError:
            tries -= 1
            if tries == 0:
                raise
            out.unbind(bound)


def control_frames(msg: dict[str, Any]) -> list[bytes]:
    """A control message to a trainer: ``[b"ctl", msgpack(msg)]``."""
    return [CONTROL, msgpack.packb(msg)]


async def push_polling(sock: zmq.asyncio.Socket, frames: Sequence[Any], what: str, address: str, warn_s: float
                       ) -> None:
    """Queue one message on a PUSH-like socket without blocking the loop: poll every 10 ms while its queue is
    full or no peer is connected, warning every ``warn_s`` that nobody takes ``what``."""
    loop = asyncio.get_running_loop()
    t0 = last = loop.time()
    while True:
        try:
            await sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            await asyncio.sleep(0.01)
            if loop.time() - last >= warn_s:
                last = loop.time()
                log.warning("no trainer takes %s at %s (%.0f s so far); waiting", what, address, last - t0)


class BatchSender(Sender[list[Any]]):
    """Orchestrator side of the ZMQ link (see the module docstring); ``unacked`` keeps each step's frames."""

    kind = "zmq"

    def __init__(self, router: zmq.asyncio.Socket, pull: zmq.asyncio.Socket, address: str, window: int,
                 warn_s: float, require_report: bool, keep: int = 0, acked_before: int = -1) -> None:
        super().__init__(address, window, warn_s, keep=keep, acked_before=acked_before)
        self.router, self.pull = router, pull
        self._router_now: zmq.Socket[bytes] = zmq.Socket.shadow(router.underlying)  # control: now or never
        self.require_report = require_report
        self.on_ack: Callable[[int], None] = lambda _step: None  # e.g. release a step's shared memory
        self.pool: ShmPool | None = None  # set by open(shm_bytes=...): columns go through shared memory
        self.seat = TrainerSeat(SEAT_GRACE_S)
        self.marker_dir: Path | None = None
        self._sent_to_holder = -1  # the last step the holder has been sent (or held when it took the seat)
        self._unreachable = ""  # why the holder does not take the next step, while that lasts
        self._checkpoints = CheckpointFeed()
        self._told_anonymous = False
        self.pools: dict[str, dict[str, Any]] = {}  # direct: the pool announcement of each worker, by name
        self._lost: LostStep | None = None  # direct: the holder's newest report of a step it could not map
        self._lost_news = asyncio.Event()
        self._replaced = 0  # replaced steps so far: a send under way when one is replaced does not count
        self._offers: tuple[str, ...] = ()  # the weight transfer backends the holder can send with
        # its answers to transfer requests; bounded: a trainer answers each request once or twice, one at a time
        self._transfer_events: asyncio.Queue[tuple[bytes, TransferEvent]] = asyncio.Queue(maxsize=TRANSFER_EVENTS)

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str, hwm: int = 2, warn_s: float = 30.0, *, require_report: bool = False,
                   shm_bytes: int | None = None, server_keys: ServerKeys | None = None, keep: int = 0,
                   acked_before: int = -1) -> AsyncIterator[BatchSender]:
        """Bind; the trainer channel and the sends to the trainer run in tasks this context owns. ``hwm``:
        unacknowledged steps kept; ``keep``: acknowledged ones kept for a trainer that comes back behind them
        (not with shared memory, whose spans are reused once acknowledged); ``acked_before``: the step an
        earlier run saw acknowledged. ``shm_bytes``: send columns through a shared-memory pool of that size,
        served next to ``address``. ``server_keys``: both sockets are CURVE servers that accept only the
        authorized trainers (receivers given the matching ``ClientKeys``)."""
        if shm_bytes is not None:
            pool_socket_path(address)  # TransportError for tcp://, before anything starts
            if keep:
                raise TransportError("acknowledged steps cannot be kept with shared memory (their spans are "
                                     "reused): transport.keep_acked must be 0 with kind = 'shm'")
        async with contextlib.AsyncExitStack() as stack:
            pool = None if shm_bytes is None else stack.enter_context(contextlib.closing(ShmPool(shm_bytes, warn_s)))
            sender = await stack.enter_async_context(cls._open(address, hwm, warn_s, require_report, server_keys,
                                                               keep, acked_before))
            if pool is not None:  # served once the batch address is ours; closed before the pool is
                await stack.enter_async_context(serve_pool(pool, pool_socket_path(sender.address)))
                sender.pool, sender.on_ack, sender.kind = pool, pool.release_through, "shm"
            yield sender

    @classmethod
    @contextlib.asynccontextmanager
    async def _open(cls, address: str, hwm: int, warn_s: float, require_report: bool,
                    server_keys: ServerKeys | None, keep: int, acked_before: int) -> AsyncIterator[BatchSender]:
        ctx = zmq.asyncio.Context()
        auth = contextlib.ExitStack()
        router = ctx.socket(zmq.ROUTER)
        pull = ctx.socket(zmq.PULL)
        files: list[str] = []  # endpoints bound: ours to remove
        try:
            if server_keys is not None:
                server = auth.enter_context(curve_server(ctx, server_keys))
                server.secure(router)
                server.secure(pull)
            router.setsockopt(zmq.SNDHWM, hwm)
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full or missing peer is an error (EAGAIN,
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # EHOSTUNREACH), never a silent drop; a reconnect takes over
            router.setsockopt(zmq.LINGER, 2000)
            pull.setsockopt(zmq.LINGER, 0)
            ipc.prepare(address)
            try:
                bound = _bind_pair(router, pull, address)
                files += [bound, ckpt_address(bound)]
            except zmq.ZMQError as e:
                raise TransportError(f"cannot bind the trainer's address {address}: {e}") from None
            sender = cls(router, pull, bound, hwm, warn_s, require_report, keep, acked_before)
            try:  # a failed loop (a socket error) ends the block with its error, not a silent stall
                async with background(("trainer-channel", sender._read_trainer()),
                                      ("trainer-sends", sender._send_to_holder())):
                    yield sender
            finally:
                if sender.unacked:
                    log.warning("closing with steps %s not acknowledged by the trainer", sorted(sender.unacked))
        finally:
            router.close()
            pull.close()
            auth.close()  # the authenticator's sockets close too, or term() would wait for them for ever
            ctx.term()
            for endpoint in files:  # libzmq leaves ipc:// files behind (orchestrator.ipc)
                ipc.remove(endpoint)

    @property
    def trainer_has(self) -> int | None:
        """The last step the trainer reported holding (None: no report yet)."""
        return self.window.peer_has

    @property
    def holder(self) -> Peer | None:
        """The trainer this link feeds (None: none yet, or it was refused)."""
        return self.seat.holder

    def run_finished(self) -> None:
        if (holder := self.seat.holder) is None:
            return
        if self._tell(holder.id, {"ctl": "end"}):  # the socket's linger (2 s) delivers it as the run closes
            log.info("told trainer %s that the run has ended", holder.name)
        elif not self.unacked:  # it acknowledged every step, then left: the usual end of a trainer given max_steps
            log.info("trainer %s acknowledged every step and has left", holder.name)
        else:
            log.warning("could not tell trainer %s that the run has ended (not connected): one waiting to be asked "
                        "for its weights waits out its own bound", holder.name)

    def checkpoint_wanted(self, policy: int) -> str:
        holder = self.seat.holder
        if holder is None:
            return self._no_trainer()
        self._tell(holder.id, {"ctl": "checkpoint", "min": policy})
        latest = self._checkpoints.latest
        said = f"checkpoint {latest.step}" if latest is not None else "no checkpoint"
        return f"trainer {holder.name} at {self.address} has announced {said}; asked it for its newest"

    async def _before_send(self, step: int) -> None:
        if self.require_report:  # after a restart: learn what the trainer has before sending anything
            await self._wait(lambda: self.window.peer_has is not None, step,
                             lambda: f"has not reported its last step ({self._no_trainer()})")

    async def _wait_room(self, step: int) -> None:
        self.waiting = True
        try:
            await self._wait(lambda: not self.window.full, step,
                             lambda: f"has not acknowledged steps {sorted(self.window.unacked)}{self._link_state()}")
        finally:
            self.waiting = False

    async def _deliver(self, batch: Batch | StepManifest) -> tuple[list[Any], int]:
        """The step's frames (the header alone when the columns went into shared memory, waiting while the pool
        has no room; the manifest alone in direct mode); ``_send_to_holder`` sends them once the step is in the
        window."""
        if isinstance(batch, StepManifest):
            frames: list[Any] = [encode_manifest(batch)]
        else:
            frames = encode(batch) if self.pool is None else await self.pool.frames(batch)
        return frames, sum(len(f) for f in frames)

    def announce_pool(self, worker: str, pool: Mapping[str, Any]) -> None:
        """Direct mode: ``worker``'s column pool is ``pool`` (id, size, host, path): tell the trainer now, and
        every trainer that takes the seat later."""
        msg = {"ctl": "pool", "worker": worker, **pool}
        self.pools[worker] = msg
        holder = self.seat.holder
        if holder is not None:
            self._tell(holder.id, msg)

    def forget_pool(self, worker: str, pool: str) -> None:
        """Direct mode: ``worker``'s pool ``pool`` is gone: trainers taking the seat are not told about it."""
        if self.pools.get(worker, {}).get("id") == pool:
            del self.pools[worker]

    async def lost_steps(self) -> AsyncIterator[LostStep]:
        """Direct mode: the steps the trainer holding the seat reports it could not map (its newest report
        each time; a receiver repeats its report every STATUS_S until it has a newer attempt, so the consumer
        ignores reports of attempts it has already replaced)."""
        while True:
            await self._lost_news.wait()
            self._lost_news.clear()
            lost, self._lost = self._lost, None
            if lost is not None:
                yield lost

    def replace(self, manifest: StepManifest) -> None:
        """Direct mode: ``manifest`` is a new attempt of a step sent and not acknowledged (KeyError otherwise):
        it goes to the trainer instead of the old one, followed again by every step after it (the trainer drops
        the later steps it got while the step was lost)."""
        step = manifest.step
        self.window.replace(step, [encode_manifest(manifest)])
        self._sent_to_holder = min(self._sent_to_holder, step - 1)
        self._replaced += 1
        self._notify()

    async def _handed_over(self, step: int) -> None:
        self._notify()
        await self._wait(lambda: self._sent_to_holder >= step or step not in self.window.unacked, step,
                         lambda: f"has not taken it: {self._link_state().removeprefix('; ') or 'sending'}")

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        if self.pool is not None:  # kind = shm: live MB and spans of the pool
            out.update(self.pool.metrics())
        return out

    async def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[Checkpoint]:
        """Checkpoints announced by the trainer (ZMQ, or marker files when ``marker_dir`` is set)."""
        if marker_dir is not None:
            self.marker_dir = marker_dir
            async for ckpt in marker_announcements(marker_dir):
                yield ckpt
        async for ckpt in self._checkpoints.updates():
            yield ckpt

    # ------------------------------------------------------------------------------ weights over the wire

    def broadcast_offer(self) -> tuple[Peer, tuple[str, ...]] | None:
        """The trainer holding the seat and the weight transfer backends it can send with; None: no trainer."""
        holder = self.seat.holder
        return None if holder is None else (holder, self._offers)

    def tell_transfer(self, request: TransferRequest) -> bool:
        """Send the holder ``request``: False when no trainer holds the seat or its connection is gone."""
        holder = self.seat.holder
        return holder is not None and self._tell(holder.id, request_message(request))

    async def transfer_event(self) -> tuple[bytes, TransferEvent]:
        """The next answer a trainer sent to a transfer request, with its id."""
        return await self._transfer_events.get()

    def trainer_connected(self) -> bool:
        return self._holder_connected()

    # --------------------------------------------------------------------------------- sends to the holder

    async def _send_to_holder(self) -> None:
        """Consumes the window's unacknowledged steps; produces sends to the trainer holding the seat, each
        once, in order (all of them again to a trainer that takes the seat). Waits for a holder, and polls
        (every 10-100 ms) while the holder is not connected or its queue is full; wakes on ``_notify``."""
        while True:
            holder = self.seat.holder
            todo = [(s, f) for s, f in self.window.unacked.items() if s > self._sent_to_holder]
            if holder is None or not todo:
                self._changed.clear()
                await self._changed.wait()
                continue
            step, frames = todo[0]
            assert frames is not None  # every step this sender records keeps its frames
            replaced = self._replaced
            if await self._route(holder, frames) and self.seat.holder is holder and replaced == self._replaced:
                self._sent_to_holder = step
                self._notify()

    async def _route(self, holder: Peer, frames: Sequence[Any]) -> bool:
        """Send one message to ``holder``: True once queued, False if it lost the seat meanwhile."""
        pause = 0.01
        while self.seat.holder is holder:
            try:
                await self.router.send_multipart([holder.id, *frames], flags=zmq.NOBLOCK, copy=False)
                self._unreachable = ""
                return True
            except zmq.Again:
                self._unreachable = f"trainer {holder.name} does not take more (its queue is full)"
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self._unreachable = f"trainer {holder.name} is not connected"
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        return False

    def _tell(self, peer: bytes, msg: dict[str, Any]) -> bool:
        """A control message to ``peer``, if it can take one now: whether it is connected."""
        try:
            self._router_now.send_multipart([peer, *control_frames(msg)], flags=zmq.NOBLOCK)
        except zmq.Again:
            return True  # connected, its queue full
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            return False
        return True

    def _link_state(self) -> str:
        """``"; <why the trainer does not get steps>"``, or "" when nothing stands in the way."""
        if self.seat.holder is None:
            return f"; {self._no_trainer()}"
        return f"; {self._unreachable}" if self._unreachable else ""

    def _no_trainer(self) -> str:
        refused = "; ".join(f"refused one: {why}" for why in list(self.seat.refused.values())[-2:])
        return f"no trainer is connected to {self.address}" + (f" ({refused})" if refused else "")

    # ------------------------------------------------------------------------------------ the trainers' messages

    async def _read_trainer(self) -> None:
        """Consumes the trainers' messages; produces acknowledgements, the seat's holder and checkpoints."""
        while True:
            raw = await self.pull.recv()
            try:
                report = decode_report(raw)
            except WireError as e:
                log.warning("ignored a malformed message from the trainer (%d bytes): %s", len(raw), e)
                continue
            self._heard(report)

    def _heard(self, r: TrainerReport) -> None:
        if r.peer is None:  # no id: it cannot receive batches (an older receiver, or an announcer only)
            if r.announced is not None:
                self._checkpoints.offer(r.announced)
            if r.have is not None and not self._told_anonymous:
                self._told_anonymous = True
                log.warning("a trainer that does not send an id reports step %d at %s; it cannot receive batches "
                            "from this orchestrator: update its orchestrator.transport", r.have, self.address)
            return
        verdict = self.seat.hear(r.peer, r.who, asyncio.get_running_loop().time(), lambda: self._holder_connected())
        if verdict in (Verdict.REFUSED, Verdict.IGNORED):
            why = self.seat.refused[r.peer]
            if verdict is Verdict.REFUSED:
                log.warning("refused trainer %s at %s: %s", r.who, self.address, why)
            self._tell(r.peer, {"ctl": "refused", "why": why})  # again to an ignored one: it may have missed it
            return
        if verdict is Verdict.WAIT:
            return
        if verdict is Verdict.ADMITTED:
            self._offers = ()
            if not self._admit(r):
                return
        if r.broadcast is not None:
            self._offers = tuple(r.broadcast)
        if r.transfer is not None and r.peer is not None:
            try:
                self._transfer_events.put_nowait((r.peer, r.transfer))
            except asyncio.QueueFull:
                log.warning("dropped a weight transfer answer from trainer %s (%s): %d unread", r.who,
                            r.transfer.event, TRANSFER_EVENTS)
        if r.announced is not None:  # repeats are harmless: the feed keeps only newer ones
            self._checkpoints.offer(r.announced)
        if r.have is not None:
            done = self.window.acknowledge(r.have)
            if done:
                self.on_ack(done[-1])
        lost = r.lost_step
        if lost is not None and lost.step in self.window.unacked:
            self._lost = lost
            self._lost_news.set()
        self._notify()

    def _holder_connected(self) -> bool:
        holder = self.seat.holder
        return holder is not None and self._tell(holder.id, {"ctl": "ping"})

    def _admit(self, r: TrainerReport) -> bool:
        """``r``'s trainer took the seat: it gets every kept step after what it holds, or is refused when it
        lacks steps that are gone. Whether it stays."""
        have = -1 if r.have is None else r.have
        gone = self.window.rejoin(have)
        if gone:
            why = (f"it holds steps up to {have}, but steps {_span(gone)} were acknowledged before (by this "
                   f"trainer or the one before it) and are no longer kept (transport.keep_acked = {self.window.keep}); "
                   f"restart it from a checkpoint of step {gone[-1]} or later")
            log.error("refused trainer %s at %s: %s", r.who, self.address, why)
            self.seat.refuse(r.peer or b"", why)
            self._tell(r.peer or b"", {"ctl": "refused", "why": why})
            self._notify()
            return False
        self._sent_to_holder = have
        for msg in self.pools.values():  # before any step: it maps the pools they will name
            self._tell(r.peer or b"", msg)
        resend = [s for s in self.window.unacked if s > have]
        log.info("trainer %s at %s holds steps up to %d%s", r.who, self.address, have,
                 f"; sending it steps {_span(resend)}" if resend else "")
        return True


def _span(steps: Sequence[int]) -> str:
    return str(steps[0]) if len(steps) == 1 else f"{steps[0]}..{steps[-1]}"

