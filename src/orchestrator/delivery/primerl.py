"""prime-rl's trainer, fed unchanged: ``[transport] kind = "prime-rl"`` (prime-rl 559b447, 2026-08-21).

prime-rl's trainer reads per-rank micro-batches that the orchestrator packs (``balance.pack_ranks``, encoded by
``primerl_wire``), one message per data rank per step, and publishes its weights as files. Two layouts, as
prime-rl's ``rollout_transport.type`` (``src/prime_rl/transports/rollouts/{zmq,filesystem}.py``):

- **zmq**: we bind a publisher on ``address`` (``tcp://HOST:PORT``) and a PULL socket on ``PORT + 1``. Each
  data rank r connects a SUB with topic ``data_rank|<r>|`` and pushes its rank (``b"<r>"``, READY) once when it
  starts. Per step, rank r gets ``[b"data_rank|<r>|", msgpack(list[MicroBatch])]``. The publisher is an XPUB
  (a PUB to the SUBs, which also hands us their subscriptions): a step goes out only when every rank has sent
  READY *and* its subscription has reached us (PUB drops messages nobody is subscribed to; READY alone races
  the subscription), and ``XPUB_NODROP`` makes a full queue wait instead of drop.
- **filesystem**: ``<trainer_dir>/rollouts/step_<N>/rank_<R>.bin`` holds the same payload, written to
  ``rank_<R>.bin.tmp`` (fsynced) and renamed: the trainer polls for the final name.

**Steps.** prime-rl's trainer starts at step 1 (``Progress.step``; resumed from checkpoint R: R + 1) and counts
messages: no step is on the wire. Our steps start at 0, so **our step k is the trainer's step k + 1**
(``rollouts/step_<k+1>``). After training its step N the trainer writes ``<trainer_dir>/broadcasts/step_N/``
and touches ``STABLE`` (at start, ``step_<R>``: ``step_0`` on a fresh run); so ``broadcasts/step_N`` is
``Checkpoint(N, that directory)`` for the weight sync, and it **acknowledges our step N - 1**: ``acked`` is the
newest complete broadcast minus one.

**Gating.** prime-rl's orchestrator holds its batch s until the trainer has published v(s - 1 - TARGET_LAG),
TARGET_LAG = 1 (``finalize_train_batch``), so at most 2 steps are sent and not yet trained. Here that is the
delivery window with ``bound`` = ``transport.send_hwm`` (default 2, exactly prime-rl's rule): our step k waits
for ``broadcasts/step_<k + 1 - bound>``. A rank's queue then never holds more than ``bound`` messages, below
the publisher's high-water mark (``2 * bound + 1``, at least prime-rl's 10: libzmq counts a pipe's reads
late by up to half its mark), so nothing is ever dropped there.

**Restarts.** prime-rl's link has no acknowledgement but the broadcasts, and its trainer sends READY once.
- *Orchestrator* (``--resume``): steps the trainer holds (<= newest broadcast - 1) are skipped; the next one
  goes out as trainer step newest + 1, so the trainer must resume from checkpoint ``step_<newest>``
  (filesystem layout: files already written for a step are kept, not written again). A prime-rl trainer
  that kept running never sends READY again: restart it from that checkpoint too (the log says so).
- *Trainer* (this process keeps running): a rank whose subscription goes away is lost; when it subscribes
  again and sends READY, it gets every unacknowledged step again, in order; it must resume from checkpoint
  ``step_<acked + 1>`` (the newest broadcast) for the count to line up.

**No authentication.** prime-rl's sockets have no CURVE: anyone who reaches ``address`` can subscribe to the
batches or send READY. Bind loopback (``security.allow_unauthenticated_trainer`` opts in to anything else).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import zmq
import zmq.asyncio

from orchestrator.background import background
from orchestrator.contracts.checkpoints import Checkpoint, CheckpointFeed, broadcast_steps, latest_broadcast
from orchestrator.contracts.wire import Batch
from orchestrator.delivery.balance import BinCost, token_count
from orchestrator.delivery.primerl_wire import EncodedStep, encode_step
from orchestrator.delivery.sender import Sender
from orchestrator.delivery.zmq_link import push_polling
from orchestrator.errors import TransportError

log = logging.getLogger(__name__)

Layout = Literal["zmq", "filesystem"]
PRIMERL_HWM = 10  # prime-rl's default rollout_transport.hwm
ROLLOUTS = "rollouts"


def topic(rank: int) -> bytes:
    """The SUB topic of data rank ``rank``; the trailing ``|`` keeps rank 1 from matching rank 10."""
    return b"data_rank|%d|" % rank


def trainer_step(step: int) -> int:
    """The prime-rl trainer's step for our ``step`` (it counts from 1)."""
    return step + 1


def rank_file(trainer_dir: Path, step: int, rank: int) -> Path:
    """Where the filesystem layout puts data rank ``rank``'s payload of our ``step``."""
    return trainer_dir / ROLLOUTS / f"step_{trainer_step(step)}" / f"rank_{rank}.bin"


class RankPresence:
    """Which data ranks can receive (no I/O): a rank is present once its topic is subscribed on our publisher
    and it has sent READY since it (re)joined. A rank whose subscription goes away is lost; it needs READY
    again, and when it is back it is in ``take_rejoined()`` (to get the unacknowledged steps again)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.subscribed: set[int] = set()
        self.ready: set[int] = set()
        self.lost: set[int] = set()  # present once, gone since: back when subscribed and READY again

    @property
    def complete(self) -> bool:
        return len(self.subscribed & self.ready) == self.ranks

    def missing(self) -> str:
        """Which ranks the trainer still lacks, in words."""
        everyone = set(range(self.ranks))
        parts = [f"READY from ranks {sorted(everyone - self.ready)}"] if everyone - self.ready else []
        if everyone - self.subscribed:
            parts.append(f"subscriptions of ranks {sorted(everyone - self.subscribed)}")
        return "has not sent " + " and ".join(parts) if parts else "is present"

    def subscription(self, message: bytes) -> None:
        """An XPUB message: ``\\x01`` + topic (subscribed) or ``\\x00`` + topic (its last subscriber left)."""
        rank = _rank_of_topic(message[1:])
        if rank is None or rank >= self.ranks:
            return
        if message[:1] == b"\x01":
            self.subscribed.add(rank)
        elif message[:1] == b"\x00" and rank in self.subscribed:
            self.subscribed.discard(rank)
            if rank in self.ready:
                self.ready.discard(rank)
                self.lost.add(rank)
                log.warning("prime-rl trainer rank %d unsubscribed (its process ended?); steps wait until it "
                            "subscribes and sends READY again", rank)

    def on_ready(self, message: bytes) -> None:
        """A READY message: the rank as ASCII decimal (prime-rl's ``str(data_rank).encode()``)."""
        try:
            rank = int(message.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            log.warning("ignored a READY message that is not a rank number: %r", message[:32])
            return
        if not 0 <= rank < self.ranks:
            log.warning("ignored READY from rank %d: transport.data_ranks is %d", rank, self.ranks)
            return
        self.ready.add(rank)  # a repeat (context-parallel peers share a rank) changes nothing

    def take_rejoined(self) -> list[int]:
        """Ranks that were lost and are present again (each returned once)."""
        back = sorted(r for r in self.lost if r in self.subscribed and r in self.ready)
        self.lost.difference_update(back)
        return back


def _rank_of_topic(raw: bytes) -> int | None:
    head, _, rest = raw.partition(b"|")
    digits, bar, tail = rest.partition(b"|")
    if head != b"data_rank" or not bar or tail or not digits.isdigit():
        return None
    return int(digits)


class PrimeRLSender(Sender[list[memoryview]]):
    """Orchestrator side of prime-rl's rollout transport (see the module docstring). ``unacked`` keeps each
    step's per-rank payloads (zmq: to resend to a restarted rank; filesystem: nothing, the files stay)."""

    kind = "prime-rl"

    def __init__(self, trainer_dir: Path, address: str, layout: Layout, ranks: int, window: int,
                 encode: Callable[[Batch], EncodedStep], resume: bool, warn_s: float) -> None:
        super().__init__(address, window, warn_s)
        self.trainer_dir, self.layout, self.ranks = trainer_dir, layout, ranks
        self.encode, self.resume = encode, resume
        self.presence = RankPresence(ranks)
        self.last: EncodedStep | None = None  # the last step encoded, for metrics
        self.xpub: zmq.asyncio.Socket | None = None  # zmq layout
        self._broadcasts = CheckpointFeed()
        self._publishing = asyncio.Lock()  # a resend and a new step never interleave their messages
        self._resending = False

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, trainer_dir: str | Path, *, data_ranks: int, seq_len: int, pad_to_multiple_of: int = 1,
                   layout: Layout = "zmq", address: str | None = None, window: int = 2,
                   temperature: float | Mapping[str, float] = 1.0, bin_cost: BinCost = token_count,
                   resume: bool = False, warn_s: float = 30.0, poll_s: float = 0.2) -> AsyncIterator[PrimeRLSender]:
        """Bind (zmq) and watch ``<trainer_dir>/broadcasts`` (every ``poll_s``) from tasks this context owns.
        TransportError if the trainer directory holds an earlier run's steps and ``resume`` is not set, or the
        address cannot be bound."""
        trainer_dir = await asyncio.to_thread(Path(trainer_dir).resolve)
        await asyncio.to_thread(_check_leftovers, trainer_dir, layout, resume)
        encode = functools.partial(encode_step, seq_len=seq_len, ranks=data_ranks,
                                   pad_to_multiple_of=pad_to_multiple_of, temperature=temperature, bin_cost=bin_cost)
        async with contextlib.AsyncExitStack() as stack:
            xpub = pull = None
            if layout == "zmq":
                if address is None:
                    raise TransportError("the prime-rl zmq layout needs transport.address = 'tcp://HOST:PORT'")
                ctx = zmq.asyncio.Context()
                stack.callback(ctx.term)
                xpub, pull = _bind(ctx, address, window)
                stack.callback(xpub.close)
                stack.callback(pull.close)
            bound = xpub.getsockopt_string(zmq.LAST_ENDPOINT) if xpub is not None else str(trainer_dir / ROLLOUTS)
            sender = cls(trainer_dir, bound, layout, data_ranks, window, encode, resume, warn_s)
            sender.xpub = xpub
            await sender._scan_broadcasts()
            loops = [("prime-rl-broadcasts", sender._watch_broadcasts(poll_s))]
            if xpub is not None and pull is not None:
                loops.append(("prime-rl-ranks", sender._watch_ranks(xpub, pull)))
            sender._log_start()
            try:
                async with background(*loops):
                    yield sender
            finally:
                if sender.unacked:
                    log.warning("closing with steps %s not trained by the prime-rl trainer (no broadcast yet)",
                                sorted(sender.unacked))

    def _log_start(self) -> None:
        first = self.acked + 1
        log.info("prime-rl trainer (%s layout, %d data ranks) at %s; weights from %s/broadcasts; our step %d is "
                 "its step %d%s", self.layout, self.ranks, self.address, self.trainer_dir, first, trainer_step(first),
                 f" (resume the trainer from checkpoint step_{first})" if self.resume else "")

    def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[Checkpoint]:
        """The newest complete ``broadcasts/step_N`` each time there is a newer one (``marker_dir`` unused)."""
        return self._broadcasts.updates()

    def checkpoint_wanted(self, policy: int) -> str:
        """prime-rl's trainer cannot be asked: says where its weights appear and what it is known to lack."""
        latest = self._broadcasts.latest
        newest = f"the newest is step_{latest.step}" if latest is not None else "there is none yet"
        missing = "" if self.layout != "zmq" or self.presence.complete else f"; the trainer {self._missing()}"
        return (f"prime-rl's trainer publishes {self.trainer_dir}/broadcasts/step_N/STABLE after training our step "
                f"N - 1 ({newest}){missing}")

    def metrics(self) -> dict[str, Any]:
        out = super().metrics()
        if self.last is not None:
            out["transport"].update(micro_batches_per_rank=self.last.micro_batches, pad_tokens=self.last.pad_tokens,
                                    dummy_micro_batches=self.last.dummies, truncated_samples=self.last.truncated)
        return out

    # ------------------------------------------------------------------------------------------ delivery

    async def _delivered_before(self, step: int) -> bool:
        if self.layout != "filesystem" or not self.resume:
            return False
        paths = [rank_file(self.trainer_dir, step, r) for r in range(self.ranks)]
        return await asyncio.to_thread(lambda: all(p.exists() for p in paths))

    async def _deliver(self, batch: Batch) -> tuple[list[memoryview] | None, int]:
        """Encode in a worker thread, then publish one message per rank (zmq, once every rank is present) or
        write one file per rank (filesystem, in a worker thread)."""
        encoded = await asyncio.to_thread(self.encode, batch)
        self.last = encoded
        if batch.num_samples == 0:
            log.warning("step %d has no samples: each prime-rl rank gets one micro-batch of pad tokens and no loss, "
                        "so the trainer's step count stays ours + 1", batch.step)
        if self.layout == "filesystem":
            await asyncio.to_thread(_write_rank_files, self.trainer_dir, batch.step, encoded.messages)
            return None, encoded.nbytes
        if not self.presence.complete:
            log.info("step %d waits for the prime-rl trainer at %s, which %s", batch.step, self.address,
                     self.presence.missing())
        await self._wait(lambda: self.presence.complete and not self._resending, batch.step, self._missing)
        async with self._publishing:
            await self._publish(batch.step, encoded.messages, range(self.ranks))
        return encoded.messages, encoded.nbytes

    def _missing(self) -> str:
        why = self.presence.missing()
        if not self.presence.ready and self.resume:
            why += ("; a prime-rl trainer that kept running while the orchestrator restarted never sends READY "
                    f"again: restart it from checkpoint step_{self.acked + 1}")
        return why

    async def _publish(self, step: int, messages: list[memoryview], ranks: range | list[int]) -> None:
        assert self.xpub is not None
        for r in ranks:
            await push_polling(self.xpub, [topic(r), messages[r]], f"step {step} (rank {r})", self.address,
                               self.warn_s)

    # ------------------------------------------------------------------------------------------ the trainer

    async def _scan_broadcasts(self) -> None:
        """Acknowledge through the newest complete broadcast and offer it for the weight sync."""
        latest = await asyncio.to_thread(latest_broadcast, self.trainer_dir)
        if latest is not None and self._broadcasts.offer(latest):
            self.window.acknowledge(latest.step - 1)  # broadcast N: the trainer trained our step N - 1
            self._notify()

    async def _watch_broadcasts(self, poll_s: float) -> None:
        """Consumes ``broadcasts/step_N/STABLE`` (polled every ``poll_s``); produces acknowledgements and
        checkpoints. Runs until cancelled."""
        while True:
            await asyncio.sleep(poll_s)
            await self._scan_broadcasts()

    async def _watch_ranks(self, xpub: zmq.asyncio.Socket, pull: zmq.asyncio.Socket) -> None:
        """Consumes subscriptions (XPUB) and READY messages (PULL); produces rank presence, and resends to
        ranks that came back. Runs until cancelled."""
        poller = zmq.asyncio.Poller()
        poller.register(xpub, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            if xpub in events:
                self.presence.subscription(await xpub.recv())
            if pull in events:
                self.presence.on_ready(await pull.recv())
            rejoined = self.presence.take_rejoined()
            if rejoined and self.window.unacked:
                await self._resend(rejoined)
            self._notify()

    async def _resend(self, ranks: list[int]) -> None:
        self._resending = True  # before any await: a send woken now publishes after the resend
        try:
            async with self._publishing:
                log.info("prime-rl trainer ranks %s are back: resending steps %s (the trainer must have resumed "
                         "from checkpoint step_%d)", ranks, sorted(self.window.unacked), self.acked + 1)
                for step, messages in list(self.window.unacked.items()):
                    assert messages is not None  # the zmq layout keeps every step's messages
                    await self._publish(step, messages, ranks)
        finally:
            self._resending = False


def _bind(ctx: zmq.asyncio.Context, address: str, window: int) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """XPUB on ``address`` and PULL on its port + 1 (port 0: the first free pair). TransportError if not."""
    host, _, port_text = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not port_text.isdigit():
        raise TransportError(f"the prime-rl trainer needs a tcp://HOST:PORT address, got {address!r}")
    port = int(port_text)
    error: zmq.ZMQError | None = None
    for _attempt in range(20 if port == 0 else 1):
        xpub, pull = ctx.socket(zmq.XPUB), ctx.socket(zmq.PULL)
        xpub.setsockopt(zmq.SNDHWM, max(PRIMERL_HWM, 2 * window + 1))
        xpub.setsockopt(zmq.XPUB_NODROP, 1)  # a full queue makes the send wait (EAGAIN), never drops
        xpub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, repeats included
        xpub.setsockopt(zmq.LINGER, 2000)
        pull.setsockopt(zmq.LINGER, 0)
        try:
            xpub.bind(f"tcp://{host}:{port or '*'}")
            bound = int(xpub.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
            pull.bind(f"tcp://{host}:{bound + 1}")
            return xpub, pull
        except zmq.ZMQError as e:
            xpub.close(linger=0)
            pull.close(linger=0)
            error = e
    raise TransportError(f"cannot bind the prime-rl trainer's address {address} and the port after it: {error}")


def _check_leftovers(trainer_dir: Path, layout: Layout, resume: bool) -> None:
    """A fresh run refuses a trainer directory holding another run's steps (the trainer would read them)."""
    if resume:
        return
    stale = [s for s in broadcast_steps(trainer_dir) if s > 0]
    if stale:
        raise TransportError(f"{trainer_dir}/broadcasts holds weights of steps {stale[:5]} from an earlier run: "
                             "remove them (prime-rl's launcher does on a fresh start), or pass --resume")
    rollouts = trainer_dir / ROLLOUTS
    if layout == "filesystem" and rollouts.is_dir() and any(rollouts.glob("step_*")):
        raise TransportError(f"{rollouts} holds steps from an earlier run: remove them, or pass --resume")


def _write_rank_files(trainer_dir: Path, step: int, messages: list[memoryview]) -> None:
    """Blocking: each rank's payload to ``rank_<R>.bin.tmp``, fsynced, renamed to ``rank_<R>.bin``."""
    for r, payload in enumerate(messages):
        path = rank_file(trainer_dir, step, r)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
