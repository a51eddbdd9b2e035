"""The trainer side of the ZMQ link: ``BatchReceiver`` (asyncio) and ``SyncBatchReceiver`` (plain threads).

Each receiver connects a DEALER to the batch address (its routing id is the receiver's ``id``, random and new
for every receiver) and a PUSH to the orchestrator's trainer channel (``zmq_link.ckpt_address``). It decodes
batches without copies, rejects a corrupt, duplicate or out-of-order step with a WireError (counted in
``rejected``; the receiver keeps running), acknowledges each accepted step (``auto_ack``; or call ``ack`` after
training on it), reports the last step held every STATUS_S while idle, and ``announce(step, path)`` tells the
orchestrator that weights ``step`` are ready. Every message back names the receiver (``id``, and ``name``:
host and pid) and repeats the newest checkpoint: the one announced last, or the one it resumed from
(``checkpoint=``), so an orchestrator that (re)connects or restarted learns the weights at once instead of
waiting for an announcement that was made before it was listening.

From the orchestrator come control messages besides batches: ``refused`` (another trainer holds the link,
or this one lacks steps that are gone) makes ``recv`` raise ``TrainerRefused`` with the reason, now and on
every later call; ``checkpoint`` (the orchestrator waits for weights of step >= N) is answered with a status
message, and logged once when this trainer has announced nothing that new (``checkpoint_wanted`` holds N, for a
trainer that wants to react); ``end`` (the run trained its last step) sets ``run_ended``, and a
``serve_transfers`` waiting for weights no request will ask for returns; ``ping`` is ignored. Shared-memory
batches are mapped on arrival (see the receivers' docstrings for when they are released). ``keys``
(``ClientKeys``) makes both sockets CURVE clients, for an orchestrator that binds tcp:// with keys. Importable
without verifiers.

Step manifests (the orchestrator runs the direct data plane, docs/data-plane.md): the columns are in the
env workers' pools on this node, which the receiver maps (``trainer.reader.PoolMaps``: when a ``pool``
control message announces one, or when a manifest names one not mapped yet; blocking briefly, off the loop for
the asyncio receiver). ``recv()`` returns the step as a ``Batch`` gathered from the pools (one copy per column,
the trainer's), so every trainer works unchanged and may acknowledge at once; ``recv_view()`` returns a
``StepView`` instead (no copy): its arrays are views of the pools, whose spans the workers reuse once the step
is acknowledged, so it is acknowledged like a shared-memory batch (by the next call with ``auto_ack``). A
manifest whose pools cannot be mapped (their worker died, or replaced them, before this receiver mapped them) is
a lost step: the receiver does not return it, reports ``{"lost": N, "attempt": A, "pools": [...]}`` (in every
status message until it has step N; counted in ``lost``), drops the later steps queued behind it (the
orchestrator sends them again) and accepts step N again only as a newer attempt (the orchestrator rebuilds it
from surviving and new rollouts), so no step is returned partially, twice or out of order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeVar

import msgpack
import msgspec
import zmq
import zmq.asyncio

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.contracts.link import CONTROL, STATUS_S, ckpt_address
from orchestrator.contracts.manifest import PoolRef, StepManifest, decode_manifest, is_manifest
from orchestrator.contracts.transfer import TRANSFER
from orchestrator.contracts.wire import Batch, decode
from orchestrator.delivery.shm import PoolNotMapped, ShmAttachment
from orchestrator.errors import DuplicateStep, TrainerRefused, WireError
from orchestrator.security import ClientKeys, RefusalWatch, secure_client
from orchestrator.trainer.broadcast import TransferServer, WeightBroadcaster, Work
from orchestrator.trainer.reader import PoolMaps, PoolsLost, StepView

log = logging.getLogger(__name__)

Received = Batch | StepView  # what recv_view() returns

_S = TypeVar("_S", bound=zmq.Socket[Any])


def _hello(push: zmq.Socket[Any], status: bytes) -> None:
    """Queue a receiver's first status without waiting. With no pipe to queue it in (the connection is being
    made again, after a refused CURVE handshake), it is dropped: the status every STATUS_S says the same, so a
    constructor never raises ``zmq.Again`` (seen once under load, in test_trainer_link_auth)."""
    with contextlib.suppress(zmq.Again):
        push.send(status, flags=zmq.NOBLOCK)


def _connect(ctx: zmq.Context[_S], address: str, keys: ClientKeys | None, peer_id: str
             ) -> tuple[_S, _S, RefusalWatch]:
    """A receiver's sockets: a DEALER named ``peer_id`` on ``address`` (batches and control messages), a PUSH
    to its ``.ckpt`` twin (reports, checkpoints); both CURVE clients with ``keys``. The DEALER's refusals are
    watched from before it connects: libzmq does not retry a key the server refused, so that one event, missed,
    would never be told (seen under load; libzmq 4.3.5: one HANDSHAKE_FAILED_AUTH, then no reconnect)."""
    batches = ctx.socket(zmq.DEALER)
    batches.setsockopt(zmq.ROUTING_ID, peer_id.encode())
    batches.setsockopt(zmq.LINGER, 0)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    if keys is not None:
        secure_client(batches, keys)
        secure_client(push, keys)
    refusals = RefusalWatch(batches, address, keys, "trainer")  # checked while idle
    batches.connect(address)
    push.connect(ckpt_address(address))
    return batches, push, refusals


class _ReceiverCore:
    """What both receivers share: validation, ordering, counts, the shared-memory mapping, control messages
    and the messages back."""

    refusals: RefusalWatch  # the DEALER's failed handshakes (set by the subclass that makes the sockets)

    def __init__(self, address: str, last_step: int | None, auto_ack: bool, checkpoint: Checkpoint | None,
                 name: str | None, keys: ClientKeys | None = None, broadcaster: WeightBroadcaster | None = None
                 ) -> None:
        self.address = address
        self.id = uuid.uuid4().hex  # names this receiver to the orchestrator; its routing id too
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.last_step = last_step  # the last step accepted (a trainer resuming from a checkpoint sets it)
        self.acked = last_step  # the last step acknowledged: what the status messages report
        self.announced = checkpoint  # the newest checkpoint (announced, or resumed from): in every status message
        self.auto_ack = auto_ack
        self.rejected: dict[str, int] = {}
        self.refused: str | None = None  # why the orchestrator refused this trainer, once it did
        self.checkpoint_wanted: int | None = None  # the orchestrator waits for weights of step >= this
        self.run_ended = False  # the orchestrator said its run trained its last step: it asks nothing more
        self.shm = ShmAttachment(address)  # maps the sender's pool when a shared-memory batch arrives
        # direct: the workers' pools, mapped when announced or first named (or fetched from their span servers when
        # on other hosts, as a CURVE client with this trainer's key pair)
        self.pools = PoolMaps(keys=None if keys is None else keys.keys)
        self.announced_pools: list[PoolRef] = []  # pool announcements not mapped yet
        self._unreleased: int | None = None  # auto_ack: a shared-memory step released by the next recv
        self.lost_step: PoolsLost | None = None  # the step this receiver could not map, until a newer attempt maps
        self.lost = 0  # steps (attempts) reported lost
        self._report_lost = False  # a lost step to report now (and then in every status message)
        self._told_wanted: int | None = None
        self.transfers = None if broadcaster is None else TransferServer(broadcaster)
        self._held: deque[Sequence[Any]] = deque()  # batches read while serving transfers, for recv

    def _due_release(self) -> int | None:
        """The step a ``recv`` call releases first (auto_ack, shared memory): the previous batch is done."""
        step, self._unreleased = self._unreleased, None
        return step

    def _acks_now(self, batch: Received) -> bool:
        """Whether ``recv`` acknowledges ``batch`` before returning it: auto_ack and not views of shared memory
        (a shared-memory batch or a step view is acknowledged, i.e. released, by the next ``recv``)."""
        if self.auto_ack and (isinstance(batch, StepView) or batch.shm_pool is not None):
            self._unreleased = batch.step
            return False
        return self.auto_ack

    def _set_acked(self, step: int) -> None:
        self.acked = step
        if self._unreleased is not None and self._unreleased <= step:
            self._unreleased = None

    def _check_refused(self) -> None:
        """TrainerRefused once the orchestrator refused this trainer, or its server refused this trainer's keys
        for good (no connection is made again: see ``RefusalWatch.final``; the error says what to fix)."""
        if self.refused is not None:
            raise TrainerRefused(f"the orchestrator at {self.address} refused this trainer: {self.refused}")
        self.refusals.check()
        if self.refusals.final is not None:
            raise TrainerRefused(self.refusals.final)

    def _control(self, frames: Sequence[Any]) -> bool | None:
        """None if ``frames`` is not a control message; else whether to answer with a status message.
        TrainerRefused when it refuses this trainer."""
        if len(frames) != 2 or len(frames[0]) != len(CONTROL) or bytes(frames[0]) != CONTROL:
            return None
        try:
            msg = msgpack.unpackb(bytes(frames[1]), raw=False)
            what = msg["ctl"]
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            log.warning("ignored a malformed control message from the orchestrator: %s", e)
            return False
        if what == "refused":
            self.refused = str(msg.get("why", "no reason given"))
            log.error("the orchestrator at %s refused this trainer: %s", self.address, self.refused)
            self._check_refused()
        if what == TRANSFER and self.transfers is not None:
            self.run_ended = False  # an orchestrator resumed past its end
            self.transfers.take(msg)
            return False
        if what == "end":
            self.run_ended = True
            log.info("the orchestrator at %s has finished its run", self.address)
            return False
        if what == "checkpoint" and isinstance(msg.get("min"), int):
            self._wanted(msg["min"])
            return True
        if what == "pool":
            try:
                self.announced_pools.append(msgspec.convert({k: v for k, v in msg.items() if k != "ctl"}, PoolRef))
            except msgspec.ValidationError as e:
                log.warning("ignored a malformed pool announcement from the orchestrator: %s", e)
        return False  # "ping", or a kind this receiver does not know

    def _wanted(self, step: int) -> None:
        self.checkpoint_wanted = step
        if (self.announced is None or self.announced.step < step) and self._told_wanted != step:
            self._told_wanted = step
            have = "none" if self.announced is None else f"only step {self.announced.step}"
            log.warning("the orchestrator at %s waits for weights of step >= %d; this trainer has announced %s: "
                        "announce the weights it trains from (announce(step, path), or checkpoint= when it resumes "
                        "from a checkpoint)", self.address, step, have)

    def _accept(self, frames: Sequence[Any]) -> Batch | StepManifest | None:
        """The batch or step manifest in ``frames``, or None (rejected and counted); PoolNotMapped: call
        ``_fetch``, then again. A manifest's step counts as received only once ``_view`` has its columns."""
        try:
            if len(frames) == 1 and is_manifest(buf := getattr(frames[0], "buffer", frames[0])):
                item: Batch | StepManifest = decode_manifest(buf)
            else:
                item = decode(frames, self.shm.region)
            if isinstance(item, StepManifest) and self._behind_lost(item):
                return None
            if self.last_step is not None and item.step != self.last_step + 1:
                kind = "duplicate" if item.step <= self.last_step else "out of order"
                raise DuplicateStep(f"step {item.step} is {kind}: the last step received was {self.last_step}")
        except WireError as e:
            self._reject(e)
            return None
        self.run_ended = False  # an orchestrator resumed past its end sends steps again
        if isinstance(item, Batch):
            self.last_step = item.step
        return item

    def _behind_lost(self, m: StepManifest) -> bool:
        """Whether ``m`` is dropped because a step is lost: an attempt of it no newer than the one lost, or a
        later step queued before the rebuild (sent again after it)."""
        lost = self.lost_step
        if lost is None or m.step < lost.step or (m.step == lost.step and m.attempt > lost.attempt):
            return False
        log.debug("dropped step %d (attempt %d): waiting for step %d newer than attempt %d", m.step, m.attempt,
                  lost.step, lost.attempt)
        return True

    def _view(self, manifest: StepManifest) -> StepView | None:
        """Blocking, briefly, when a pool must be fetched: the step's views, or None (rejected and counted, or
        lost: reported by the caller's next status message)."""
        try:
            view = self.pools.view(manifest)
        except PoolsLost as e:
            self.lost_step, self._report_lost = e.with_traceback(None), True  # kept: not its frames (the manifest)
            self.lost += 1
            log.warning("%s; reporting step %d lost to the orchestrator, which rebuilds it", e, e.step)
            return None
        except WireError as e:
            self._reject(e)
            return None
        self.last_step = manifest.step
        self.lost_step = None
        return view

    def _due_lost_report(self) -> bytes | None:
        """The status message reporting a lost step, once after ``_view`` found it (later ones repeat it)."""
        if not self._report_lost:
            return None
        self._report_lost = False
        return self._status()

    def _map_announced(self) -> None:
        """Blocking, briefly: map the pools announced since the last call (a failure is only logged: the
        manifest that names the pool tries again)."""
        while self.announced_pools:
            ref = self.announced_pools.pop(0)
            try:
                self.pools.announce(ref)
            except WireError as e:
                log.warning("could not map the announced column pool %s of env worker %s: %s", ref.id, ref.worker, e)

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

    def _status(self, hello: bool = False, transfer: dict[str, Any] | None = None) -> bytes:
        msg: dict[str, Any] = {"have": -1 if self.acked is None else self.acked, "id": self.id, "name": self.name}
        if hello:
            msg["hello"] = True
        if self.transfers is not None:
            msg["broadcast"] = list(self.transfers.broadcaster.backends)
        if transfer is not None:
            msg["transfer"] = transfer
        if self.lost_step is not None:  # repeated until a newer attempt arrives: a report may be missed
            msg.update(lost=self.lost_step.step, attempt=self.lost_step.attempt, pools=self.lost_step.pools)
        if self.announced is not None:  # an orchestrator that restarted learns the newest weights from this
            msg["checkpoint"] = self.announced.step
            if self.announced.path is not None:
                msg["path"] = self.announced.path
        return msgpack.packb(msg)

    def _announcement(self, step: int, path: str | None) -> bytes:
        self.announced = Checkpoint(step, path)
        return self._status()

    def _next_transfer(self) -> tuple[bytes, Work | None] | None:
        """The status message answering the next pending transfer request now, and its blocking part (whose
        event goes in a status message after it); None when none is pending."""
        if self.transfers is None or not self.transfers.pending:
            return None
        holds = None if self.announced is None else self.announced.step
        event, work = self.transfers.begin(self.transfers.pending.popleft(), holds)
        return self._status(transfer=event), work

    def _serving(self, step: int | None, deadline: float, timeout_s: float) -> float:
        """``serve_transfers``' loop: how long to wait for the next message (> 0), 0 when done (taken, or no
        group; ``step`` None: the time is up), -1 when the time is up, or the run ended, before the weights were
        taken."""
        if self.transfers is None or (step is not None and not self.transfers.waiting_for(step)):
            return 0.0
        if self.run_ended and step is not None:  # nothing more will be asked
            log.info("the orchestrator finished its run without taking the weights of step %d", step)
            return -1.0
        left = deadline - time.monotonic()
        if left > 0:
            return left
        if step is None:
            return 0.0
        log.warning("the orchestrator has not asked for the weights of step %d within %.0f s; training on", step,
                    timeout_s)
        return -1.0

    def close_transfers(self) -> None:
        if self.transfers is not None:
            self.transfers.broadcaster.close()


class BatchReceiver(_ReceiverCore):
    """Trainer side on asyncio. ``recv()`` returns the next valid batch; invalid ones are counted in
    ``rejected``. ``last_step``: the last step this trainer holds (it resumes after it); ``checkpoint``: the
    weights it resumed from, told to the orchestrator at once (a restarted orchestrator waiting for a policy
    gets it without a new announcement); ``name``: how the orchestrator's log names it (default host:pid).

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
                 auto_ack: bool = True, keys: ClientKeys | None = None, checkpoint: Checkpoint | None = None,
                 name: str | None = None, broadcaster: WeightBroadcaster | None = None) -> None:
        super().__init__(address, last_step, auto_ack, checkpoint, name, keys, broadcaster)
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.batches, self.push, self.refusals = _connect(self.ctx, address, keys, self.id)
        # queued until the orchestrator is there; sent on a sync view so no loop is needed yet
        _hello(zmq.Socket.shadow(self.push.underlying), self._status(hello=True))

    async def recv(self) -> Batch:
        """The next valid batch (a step manifest's columns gathered from the workers' pools); TrainerRefused if
        the orchestrator refused this trainer."""
        got = await self.recv_view()
        if isinstance(got, StepView):
            batch = await asyncio.to_thread(got.gather)  # the trainer's copy (numpy releases the GIL); views may go
            self._unreleased = None
            if self.auto_ack:
                await self.ack(batch.step)
            return batch
        return got

    async def recv_view(self) -> Received:
        """The next valid step: a ``Batch``, or a ``StepView`` of the workers' pools (no copy; see the module
        docstring for when it is released); TrainerRefused if the orchestrator refused this trainer."""
        self._check_refused()
        if (done := self._due_release()) is not None:
            await self.ack(done)
        while True:
            if self.announced_pools:  # off the loop: the fd comes from another process's socket
                await asyncio.to_thread(self._map_announced)
            frames = self._held.popleft() if self._held else await self._read(STATUS_S)
            if frames is None:
                continue
            answer = self._control(frames)
            if answer is not None:
                if answer:
                    await self._say(self._status())
                await self._serve_pending()
                continue
            try:
                item = self._accept(frames)
            except PoolNotMapped as need:  # off the loop: the sender may be on this very loop
                item = self._accept(frames) if await asyncio.to_thread(self._fetch, need) else None
            got: Received | None = item if not isinstance(item, StepManifest) else (
                await asyncio.to_thread(self._view, item) if self.pools.missing(item) else self._view(item))
            if (report := self._due_lost_report()) is not None:
                await self._say(report)
            if got is not None:
                if self._acks_now(got):
                    await self.ack(got.step)
                return got

    async def _read(self, wait_s: float) -> list[Any] | None:
        """The next message's frames; None after ``wait_s`` without one (a status message is sent then)."""
        if not await self.batches.poll(int(wait_s * 1000)):
            await self._say(self._status())  # which says first if the server refused this trainer for good
            return None
        return await self.batches.recv_multipart(copy=False)

    async def _say(self, msg: bytes) -> None:
        """Send ``msg`` on the trainer channel; while there is no room (an orchestrator gone so long that its
        queue is full), wait. TrainerRefused if the server refused this trainer's keys: nothing is queued then."""
        self._check_refused()
        # pyzmq's stub for the asyncio socket's poll lacks the flags its code takes (zmq/_future.py)
        while not await self.push.poll(int(STATUS_S * 1000), zmq.POLLOUT):  # type: ignore[call-arg]
            self._check_refused()
        await self.push.send(msg)

    async def _serve_pending(self) -> None:
        while (todo := self._next_transfer()) is not None:
            now, work = todo
            await self._say(now)
            if work is not None:  # the rendezvous or the broadcast: blocking, off the loop
                await self._say(self._status(transfer=await asyncio.to_thread(work)))

    async def serve_transfers(self, step: int | None, timeout_s: float = 600.0) -> bool:
        """Weights ``step`` were just announced: serve the orchestrator's transfer requests until it has taken them
        (sent, or answered stale or failed), at most ``timeout_s``; batches that arrive meanwhile are kept for
        ``recv``. Returns at once when this trainer is in no group (the orchestrator loads checkpoints from disk).
        Whether they were taken. ``step`` None: serve them for ``timeout_s`` (a trainer busy elsewhere, between
        steps)."""
        deadline = time.monotonic() + timeout_s
        while (wait := self._serving(step, deadline, timeout_s)) > 0:
            frames = await self._read(min(wait, STATUS_S))
            if frames is not None and self._control(frames) is None:
                self._held.append(frames)  # a batch: recv takes it
            await self._serve_pending()
        return wait == 0

    async def ack(self, step: int) -> None:
        """Tell the orchestrator that every step up to ``step`` is in hand (sent by ``recv`` with auto_ack;
        without it, call this once the step is safe, e.g. trained or journalled). Shared memory: this
        releases those steps' arrays."""
        self._set_acked(step)
        await self._say(self._status())

    async def release(self, batch: Batch) -> None:
        """Done with ``batch`` (and every earlier one): ``ack(batch.step)``."""
        await self.ack(batch.step)

    async def announce(self, step: int, path: str | None = None) -> None:
        """Tell the orchestrator that weights ``step`` are ready to load (repeated in later status messages)."""
        await self._say(self._announcement(step, path))

    def close(self) -> None:
        """Close the sockets and drop the pool's mapping (unmapped once no batch views it); leave any weight
        transfer group."""
        self.close_transfers()
        self.refusals.close()
        self.batches.close()
        self.push.close()
        self.shm.close()
        self.pools.close()


class SyncBatchReceiver(_ReceiverCore):
    """Trainer side without asyncio: the same behaviour as ``BatchReceiver`` with blocking calls, shared
    memory included: with ``auto_ack`` a shared-memory batch is released by the next ``recv()`` (or by
    ``release(batch)`` / ``ack(step)``); do not touch its arrays after that."""

    def __init__(self, address: str, ctx: zmq.Context[zmq.Socket[bytes]] | None = None, *,
                 last_step: int | None = None, auto_ack: bool = True, keys: ClientKeys | None = None,
                 checkpoint: Checkpoint | None = None, name: str | None = None,
                 broadcaster: WeightBroadcaster | None = None) -> None:
        super().__init__(address, last_step, auto_ack, checkpoint, name, keys, broadcaster)
        self.ctx = ctx or zmq.Context.instance()
        self.batches, self.push, self.refusals = _connect(self.ctx, address, keys, self.id)
        _hello(self.push, self._status(hello=True))

    def recv(self, timeout_s: float | None = None) -> Batch:
        """The next valid batch (a step manifest's columns gathered from the workers' pools); TimeoutError after
        ``timeout_s`` (None: wait for ever); TrainerRefused if the orchestrator refused this trainer."""
        got = self.recv_view(timeout_s)
        if isinstance(got, StepView):
            batch = got.gather()
            self._unreleased = None
            if self.auto_ack:
                self.ack(batch.step)
            return batch
        return got

    def recv_view(self, timeout_s: float | None = None) -> Received:
        """``recv`` without the copy: a ``Batch`` or a ``StepView`` (see the module docstring)."""
        self._check_refused()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if (done := self._due_release()) is not None:
            self.ack(done)
        while True:
            self._map_announced()
            wait = STATUS_S if deadline is None else min(STATUS_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"no batch within {timeout_s} s")
            frames = self._held.popleft() if self._held else self._read(wait)
            if frames is None:
                continue
            answer = self._control(frames)
            if answer is not None:
                if answer:
                    self._say(self._status())
                self._serve_pending()
                continue
            try:
                item = self._accept(frames)
            except PoolNotMapped as need:
                item = self._accept(frames) if self._fetch(need) else None
            got = self._view(item) if isinstance(item, StepManifest) else item
            if (report := self._due_lost_report()) is not None:
                self._say(report)
            if got is not None:
                if self._acks_now(got):
                    self.ack(got.step)
                return got

    def _read(self, wait_s: float) -> list[Any] | None:
        if not self.batches.poll(int(wait_s * 1000)):
            self._say(self._status())  # which says first if the server refused this trainer for good
            return None
        return self.batches.recv_multipart(copy=False)

    def _say(self, msg: bytes) -> None:
        """As ``BatchReceiver._say``."""
        self._check_refused()
        while not self.push.poll(int(STATUS_S * 1000), zmq.POLLOUT):
            self._check_refused()
        self.push.send(msg)

    def _serve_pending(self) -> None:
        while (todo := self._next_transfer()) is not None:
            now, work = todo
            self._say(now)
            if work is not None:
                self._say(self._status(transfer=work()))

    def serve_transfers(self, step: int | None, timeout_s: float = 600.0) -> bool:
        """As ``BatchReceiver.serve_transfers``."""
        deadline = time.monotonic() + timeout_s
        while (wait := self._serving(step, deadline, timeout_s)) > 0:
            frames = self._read(min(wait, STATUS_S))
            if frames is not None and self._control(frames) is None:
                self._held.append(frames)
            self._serve_pending()
        return wait == 0

    def ack(self, step: int) -> None:
        self._set_acked(step)
        self._say(self._status())

    def release(self, batch: Batch) -> None:
        self.ack(batch.step)

    def announce(self, step: int, path: str | None = None) -> None:
        self._say(self._announcement(step, path))

    def close(self) -> None:
        self.close_transfers()
        self.refusals.close()
        self.batches.close()
        self.push.close()
        self.shm.close()
        self.pools.close()
