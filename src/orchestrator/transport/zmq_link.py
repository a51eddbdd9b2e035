"""The ZMQ link between orchestrator and trainer: batches one way; acknowledgements and checkpoints back.

Orchestrator side, ``BatchSender``: binds a PUSH socket for batches and a PULL socket for the trainer's
messages (``address`` + ``.ckpt`` for ipc, port + 1 for tcp). Every step is sent once and in order (a
step that is not the next one is refused) and kept until the trainer acknowledges it: at most ``hwm``
steps are unacknowledged, and ``send`` waits (warning every ``warn_s``) while that many are, so an absent
or slow trainer back-pressures the pipeline and memory stays bounded by ``hwm`` batches. A trainer that
(re)connects says which step it has (``hello``) and gets every kept step after it again. After a restart
(``require_report=True``) the sender waits for the trainer's report before sending anything and skips
the steps the trainer already has, so the trainer sees no step twice and no gap.
``announcements()`` yields the checkpoints the trainer announces (step and weights path), over ZMQ or as marker files
(``step_<N>.ready``) in a directory. With ``shm_bytes`` (same node, ipc:// only) the columns go through a
shared-memory pool of that size (``orchestrator.transport.shm``) and the ZMQ message is the header alone;
a step's span is freed when the trainer acknowledges (releases) it. With ``server_keys`` both sockets are
CURVE servers (``orchestrator.security``): only trainers whose public keys are authorized connect, and the
traffic is encrypted; an unauthorized peer receives nothing and its acknowledgements or announcements never
arrive.

Trainer side, ``BatchReceiver`` (asyncio) and ``SyncBatchReceiver`` (plain threads): connect PULL and
PUSH, decode batches without copies, reject a corrupt, duplicate or out-of-order step with a WireError
(counted in ``rejected``; the receiver keeps running), acknowledge each accepted step (``auto_ack``; or
call ``ack`` after training on it), report the last step held every STATUS_S while idle, and
``announce(step, path)`` tells the orchestrator that weights ``step`` are ready. Shared-memory batches are mapped
on arrival (see the receivers' docstrings for when they are released). ``keys`` (``ClientKeys``: the
orchestrator's public key and the trainer's key pair) makes both sockets CURVE clients, for an orchestrator
that binds tcp:// with keys. Importable without verifiers.

Trainer -> orchestrator messages (msgpack maps): ``{"have": N}`` (acknowledges every step <= N; -1 for
none), ``{"have": N, "hello": true}`` (a receiver started: resend what follows N), ``{"checkpoint": N,
"path": P}`` (weights N are ready in directory P; ``path`` may be absent). Status messages repeat the last
checkpoint announced, so an orchestrator restarted after the announcement still loads those weights instead
of waiting for ones that were already announced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import zmq
import zmq.asyncio

from orchestrator.errors import DuplicateStep, TransportError, WireError
from orchestrator.security import ClientKeys, RefusalWatch, ServerKeys, curve_server, secure_client
from orchestrator.transport.checkpoints import Checkpoint, CheckpointFeed, marker_announcements
from orchestrator.transport.sender import Sender
from orchestrator.transport.shm import PoolNotMapped, ShmAttachment, ShmPool, pool_socket_path, serve_pool
from orchestrator.transport.wire import Batch, decode, encode

log = logging.getLogger(__name__)

STATUS_S = 1.0  # an idle receiver reports the step it holds this often


def _bind_pair(push: zmq.asyncio.Socket, pull: zmq.asyncio.Socket, address: str) -> str:
    """Bind ``push`` at ``address`` and ``pull`` at its ``ckpt_address``; the address ``push`` got. A tcp:// port
    of ``*`` or 0 asks for any free pair: when the port after the one ``push`` got is taken, another is tried (as
    the prime-rl sender does), so a busy host's other sockets do not fail the bind."""
    tries = 20 if address.startswith("tcp://") and address.rpartition(":")[2] in ("*", "0") else 1
    while True:
        push.bind(address)
        bound = push.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when address asked for any
        try:
            pull.bind(ckpt_address(bound))
            return bound
        except zmq.ZMQError:
            tries -= 1
            if tries == 0:
                raise
            push.unbind(bound)


def ckpt_address(address: str) -> str:
    """The trainer-to-orchestrator channel next to a batch address."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        return f"tcp://{host}:{int(port) + 1}"
    return address + ".ckpt"


async def push_polling(sock: zmq.asyncio.Socket, frames: Sequence[Any], what: str, address: str, warn_s: float
                       ) -> None:
    """Queue one message on a PUSH socket without blocking the loop: poll every 10 ms while its queue is full
    or no peer is connected, warning every ``warn_s`` that nobody takes ``what``."""
    t0 = last = time.monotonic()
    while True:
        try:
            await sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            await asyncio.sleep(0.01)
            if time.monotonic() - last >= warn_s:
                last = time.monotonic()
                log.warning("no trainer takes %s at %s (%.0f s so far); waiting", what, address, last - t0)


class BatchSender(Sender[list[Any]]):
    """Orchestrator side of the ZMQ link (see the module docstring); ``unacked`` keeps each step's frames."""

    kind = "zmq"

    def __init__(self, push: zmq.asyncio.Socket, pull: zmq.asyncio.Socket, address: str, window: int,
                 warn_s: float, require_report: bool) -> None:
        super().__init__(address, window, warn_s)
        self.push, self.pull = push, pull
        self.require_report = require_report
        self.on_ack: Callable[[int], None] = lambda _step: None  # e.g. release a step's shared memory
        self.pool: ShmPool | None = None  # set by open(shm_bytes=...): columns go through shared memory
        self._checkpoints = CheckpointFeed()

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str, hwm: int = 2, warn_s: float = 30.0, *, require_report: bool = False,
                   shm_bytes: int | None = None, server_keys: ServerKeys | None = None) -> AsyncIterator[BatchSender]:
        """Bind; the trainer channel is read by a task this context owns. ``hwm``: unacknowledged steps kept.
        ``shm_bytes``: send columns through a shared-memory pool of that size, served next to ``address``.
        ``server_keys``: both sockets are CURVE servers that accept only the authorized trainers (receivers
        given the matching ``ClientKeys``); any other peer gets no batch and nothing it sends is read."""
        if shm_bytes is not None:
            pool_socket_path(address)  # TransportError for tcp://, before anything starts
        async with contextlib.AsyncExitStack() as stack:
            pool = None if shm_bytes is None else stack.enter_context(contextlib.closing(ShmPool(shm_bytes, warn_s)))
            sender = await stack.enter_async_context(cls._open(address, hwm, warn_s, require_report, server_keys))
            if pool is not None:  # served once the batch address is ours; closed before the pool is
                await stack.enter_async_context(serve_pool(pool, pool_socket_path(sender.address)))
                sender.pool, sender.on_ack, sender.kind = pool, pool.release_through, "shm"
            yield sender

    @classmethod
    @contextlib.asynccontextmanager
    async def _open(cls, address: str, hwm: int, warn_s: float, require_report: bool,
                    server_keys: ServerKeys | None) -> AsyncIterator[BatchSender]:
        ctx = zmq.asyncio.Context()
        auth = contextlib.ExitStack()
        push = ctx.socket(zmq.PUSH)
        pull = ctx.socket(zmq.PULL)
        try:
            if server_keys is not None:
                server = auth.enter_context(curve_server(ctx, server_keys))
                server.secure(push)
                server.secure(pull)
            push.setsockopt(zmq.SNDHWM, hwm)
            push.setsockopt(zmq.LINGER, 2000)
            pull.setsockopt(zmq.LINGER, 0)
            if address.startswith("ipc://"):
                Path(address.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)
            try:
                bound = _bind_pair(push, pull, address)
            except zmq.ZMQError as e:
                raise TransportError(f"cannot bind the trainer's address {address}: {e}") from None
            sender = cls(push, pull, bound, hwm, warn_s, require_report)
            reader = asyncio.create_task(sender._read_trainer(), name="trainer-channel")
            try:
                yield sender
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                if sender.unacked:
                    log.warning("closing with steps %s not acknowledged by the trainer", sorted(sender.unacked))
        finally:
            push.close()
            pull.close()
            auth.close()  # the authenticator's sockets close too, or term() would wait for them for ever
            ctx.term()

    @property
    def trainer_has(self) -> int | None:
        """The last step the trainer reported holding (None: no report yet)."""
        return self.window.peer_has

    async def _before_send(self, step: int) -> None:
        if self.require_report:  # after a restart: learn what the trainer has before sending anything
            await self._wait(lambda: self.window.peer_has is not None, step, "has not reported its last step")

    async def _deliver(self, batch: Batch) -> tuple[list[Any], int]:
        """Push the step's frames (the header alone when the columns went into shared memory); waits (memory:
        while the pool has no room for the step's columns)."""
        frames = encode(batch) if self.pool is None else await self.pool.frames(batch)
        try:
            await self._push(frames, batch.step)
        except BaseException:
            if self.pool is not None:  # never sent: its span is free again
                self.pool.drop(batch.step)
            raise
        return frames, sum(len(f) for f in frames)

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        if self.pool is not None:  # kind = shm: live MB and spans of the pool
            out.update(self.pool.metrics())
        return out

    async def _push(self, frames: Sequence[Any], step: int) -> None:
        await push_polling(self.push, frames, f"step {step}", self.address, self.warn_s)

    async def _read_trainer(self) -> None:
        """Consumes the trainer's messages; produces acknowledgements, resends and checkpoint steps."""
        while True:
            raw = await self.pull.recv()
            try:
                msg = msgpack.unpackb(raw, raw=False)
                checkpoint = None if msg.get("checkpoint") is None else Checkpoint(int(msg["checkpoint"]),
                                                                                  _path(msg.get("path")))
                have = None if msg.get("have") is None else int(msg["have"])
                if checkpoint is None and have is None:
                    raise KeyError("neither 'have' nor 'checkpoint'")
            except (ValueError, KeyError, TypeError, AttributeError, OverflowError, msgpack.UnpackException) as e:
                log.warning("ignored a malformed message from the trainer (%d bytes): %s", len(raw), e)
                continue
            if checkpoint is not None:  # repeats are harmless: the feed keeps only newer ones
                self._checkpoints.offer(checkpoint)
            if have is not None:
                await self._report(have, bool(msg.get("hello")))

    async def _report(self, have: int, hello: bool) -> None:
        if hello and self.window.peer_has is not None and have < self.window.peer_has:
            log.warning("trainer restarted holding step %d; steps up to %d were acknowledged before and are "
                        "not kept, so it continues after them", have, self.window.peer_has)
        done = self.window.acknowledge(have)
        if done:
            self.on_ack(done[-1])
        if hello and self.window.unacked:
            log.info("trainer (re)connected holding step %d: resending steps %s", have, sorted(self.window.unacked))
            for step, frames in list(self.window.unacked.items()):
                assert frames is not None  # every step this sender records keeps its frames
                await self._push(frames, step)
        self._notify()

    async def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[Checkpoint]:
        """Checkpoints announced by the trainer (ZMQ, or marker files when ``marker_dir`` is set)."""
        if marker_dir is not None:
            async for ckpt in marker_announcements(marker_dir):
                yield ckpt
        async for ckpt in self._checkpoints.updates():
            yield ckpt


_S = TypeVar("_S", bound=zmq.Socket[Any])


def _connect(ctx: zmq.Context[_S], address: str, keys: ClientKeys | None) -> tuple[_S, _S]:
    """A receiver's sockets: PULL from ``address`` (batches), PUSH to its ``.ckpt`` twin (acks, checkpoints);
    both CURVE clients with ``keys``."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    if keys is not None:
        secure_client(pull, keys)
        secure_client(push, keys)
    pull.connect(address)
    push.connect(ckpt_address(address))
    return pull, push


class _ReceiverCore:
    """What both receivers share: validation, ordering, counts, the shared-memory mapping and the messages
    back."""

    def __init__(self, address: str, last_step: int | None, auto_ack: bool) -> None:
        self.last_step = last_step  # the last step accepted (a trainer resuming from a checkpoint sets it)
        self.acked = last_step  # the last step acknowledged: what the status messages report
        self.announced: Checkpoint | None = None  # the last checkpoint announced, repeated in status messages
        self.auto_ack = auto_ack
        self.rejected: dict[str, int] = {}
        self.shm = ShmAttachment(address)  # maps the sender's pool when a shared-memory batch arrives
        self._unreleased: int | None = None  # auto_ack: a shared-memory step released by the next recv

    def _due_release(self) -> int | None:
        """The step a ``recv`` call releases first (auto_ack, shared memory): the previous batch is done."""
        step, self._unreleased = self._unreleased, None
        return step

    def _acks_now(self, batch: Batch) -> bool:
        """Whether ``recv`` acknowledges ``batch`` before returning it: auto_ack and not shared memory (a
        shared-memory batch is acknowledged, i.e. released, by the next ``recv``)."""
        if self.auto_ack and batch.shm_pool is not None:
            self._unreleased = batch.step
            return False
        return self.auto_ack

    def _set_acked(self, step: int) -> None:
        self.acked = step
        if self._unreleased is not None and self._unreleased <= step:
            self._unreleased = None

    def _accept(self, frames: Sequence[Any]) -> Batch | None:
        """The batch in ``frames``, or None (rejected and counted); PoolNotMapped: call ``_fetch``, then again."""
        try:
            batch = decode(frames, self.shm.region)
            if self.last_step is not None and batch.step != self.last_step + 1:
                kind = "duplicate" if batch.step <= self.last_step else "out of order"
                raise DuplicateStep(f"step {batch.step} is {kind}: the last step received was {self.last_step}")
        except WireError as e:
            self._reject(e)
            return None
        self.last_step = batch.step
        return batch

    def _fetch(self, need: PoolNotMapped) -> bool:
        """Blocking, briefly: map the pool a header named; False (counted) if it cannot be had."""
        try:
            self.shm.fetch(need.pool_id, need.size)
        except WireError as e:
            self._reject(e)
            return False
        return True

    def _reject(self, e: WireError) -> None:
        key = type(e).__name__
        self.rejected[key] = self.rejected.get(key, 0) + 1
        log.error("rejected a batch: %s", str(e))  # not e: its traceback would keep the batch's views alive

    def _status(self, hello: bool = False) -> bytes:
        msg: dict[str, Any] = {"have": -1 if self.acked is None else self.acked}
        if hello:
            msg["hello"] = True
        if self.announced is not None:  # a restarted orchestrator learns the newest weights from this
            msg["checkpoint"] = self.announced.step
            if self.announced.path is not None:
                msg["path"] = self.announced.path
        return msgpack.packb(msg)

    def _announcement(self, step: int, path: str | None) -> bytes:
        self.announced = Checkpoint(step, path)
        return msgpack.packb({"checkpoint": step, **({"path": path} if path is not None else {})})


class BatchReceiver(_ReceiverCore):
    """Trainer side on asyncio. ``recv()`` returns the next valid batch; invalid ones are counted in
    ``rejected``.

    Shared memory (the orchestrator runs ``transport.kind = "shm"``): the batch's columns are read-only views
    of the orchestrator's pool, mapped on the first such batch (and again after the orchestrator restarts).
    Acknowledging a step *releases* it: the orchestrator then reuses its bytes for later steps, so the
    trainer must not touch the batch's arrays (or views of them) after the release; copy what it keeps.
    With ``auto_ack`` a batch is released when ``recv()`` is called again (or by ``release(batch)`` /
    ``ack(step)`` earlier); without it, by ``release`` / ``ack``. A trainer that holds a step longer
    (e.g. several steps in flight) holds the pool's space: the orchestrator waits for room, memory stays
    bounded. Frame batches (kind = "zmq") are acknowledged on receipt with ``auto_ack``, as before.
    Fetching the pool's fd is a brief blocking call on a local socket (at most FETCH_TIMEOUT_S).
    """

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None, *, last_step: int | None = None,
                 auto_ack: bool = True, keys: ClientKeys | None = None) -> None:
        super().__init__(address, last_step, auto_ack)
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.pull, self.push = _connect(self.ctx, address, keys)
        self.refusals = RefusalWatch(self.pull, address, keys, "trainer")  # checked while idle
        # queued until the orchestrator is there; sent on a sync view so no loop is needed yet
        zmq.Socket.shadow(self.push.underlying).send(self._status(hello=True), flags=zmq.NOBLOCK)

    async def recv(self) -> Batch:
        if (done := self._due_release()) is not None:
            await self.ack(done)
        while True:
            if not await self.pull.poll(int(STATUS_S * 1000)):
                self.refusals.check()
                await self.push.send(self._status())
                continue
            frames = await self.pull.recv_multipart(copy=False)
            try:
                batch = self._accept(frames)
            except PoolNotMapped as need:  # off the loop: the sender may be on this very loop
                batch = self._accept(frames) if await asyncio.to_thread(self._fetch, need) else None
            if batch is not None:
                if self._acks_now(batch):
                    await self.ack(batch.step)
                return batch

    async def ack(self, step: int) -> None:
        """Tell the orchestrator that every step up to ``step`` is in hand (sent by ``recv`` with auto_ack;
        without it, call this once the step is safe, e.g. trained or journalled). Shared memory: this
        releases those steps' arrays."""
        self._set_acked(step)
        await self.push.send(self._status())

    async def release(self, batch: Batch) -> None:
        """Done with ``batch`` (and every earlier one): ``ack(batch.step)``."""
        await self.ack(batch.step)

    async def announce(self, step: int, path: str | None = None) -> None:
        """Tell the orchestrator that weights ``step`` are ready to load (repeated in later status messages)."""
        await self.push.send(self._announcement(step, path))

    def close(self) -> None:
        """Close the sockets and drop the pool's mapping (unmapped once no batch views it)."""
        self.refusals.close()
        self.pull.close()
        self.push.close()
        self.shm.close()


class SyncBatchReceiver(_ReceiverCore):
    """Trainer side without asyncio: the same behaviour as ``BatchReceiver`` with blocking calls, shared
    memory included: with ``auto_ack`` a shared-memory batch is released by the next ``recv()`` (or by
    ``release(batch)`` / ``ack(step)``); do not touch its arrays after that."""

    def __init__(self, address: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None, *,
                 last_step: int | None = None, auto_ack: bool = True, keys: ClientKeys | None = None) -> None:
        super().__init__(address, last_step, auto_ack)
        self.ctx = ctx or zmq.Context.instance()
        self.pull, self.push = _connect(self.ctx, address, keys)
        self.refusals = RefusalWatch(self.pull, address, keys, "trainer")  # checked while idle
        self.push.send(self._status(hello=True), flags=zmq.NOBLOCK)

    def recv(self, timeout_s: float | None = None) -> Batch:
        """The next valid batch; TimeoutError after ``timeout_s`` (None: wait for ever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if (done := self._due_release()) is not None:
            self.ack(done)
        while True:
            wait = STATUS_S if deadline is None else min(STATUS_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no batch within {timeout_s} s")
            if not self.pull.poll(int(wait * 1000)):
                self.refusals.check()
                self.push.send(self._status())
                continue
            frames = self.pull.recv_multipart(copy=False)
            try:
                batch = self._accept(frames)
            except PoolNotMapped as need:
                batch = self._accept(frames) if self._fetch(need) else None
            if batch is not None:
                if self._acks_now(batch):
                    self.ack(batch.step)
                return batch

    def ack(self, step: int) -> None:
        self._set_acked(step)
        self.push.send(self._status())

    def release(self, batch: Batch) -> None:
        self.ack(batch.step)

    def announce(self, step: int, path: str | None = None) -> None:
        self.push.send(self._announcement(step, path))

    def close(self) -> None:
        self.refusals.close()
        self.pull.close()
        self.push.close()
        self.shm.close()


def _path(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"path must be a non-empty string, got {value!r}")
    return value
