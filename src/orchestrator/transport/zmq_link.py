"""The ZMQ link between orchestrator and trainer: batches one way, checkpoint announcements the other.

Orchestrator side, ``BatchSender``: binds a PUSH socket with a send high-water mark of ``hwm`` messages
and a PULL socket for announcements (``address`` + ``.ckpt`` for ipc, port + 1 for tcp). ``send`` awaits
while the queue is full, so an absent or slow trainer back-pressures the pipeline (with a warning every
``warn_s``) and memory stays bounded by ``hwm`` batches; each step is sent once, in order, and a step
number that is not the next one is refused. ``announcements()`` yields the checkpoint steps the trainer
announces, from ZMQ or from marker files (``step_<N>.ready``) in a directory.

Trainer side, ``BatchReceiver``: connects PULL and PUSH, decodes batches without copies, rejects a
duplicate or out-of-order step with DuplicateStep (counted; the receiver keeps running), and
``announce(step)`` tells the orchestrator that weights ``step`` are ready. Importable without verifiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import zmq
import zmq.asyncio

from orchestrator.errors import DuplicateStep, WireError
from orchestrator.transport.wire import Batch, decode, encode

log = logging.getLogger(__name__)


def ckpt_address(address: str) -> str:
    """The announcement channel next to a batch address."""
    if address.startswith("tcp://"):
        host, _, port = address.removeprefix("tcp://").rpartition(":")
        return f"tcp://{host}:{int(port) + 1}"
    return address + ".ckpt"


class BatchSender:
    def __init__(self, ctx: zmq.asyncio.Context, push: zmq.asyncio.Socket, pull: zmq.asyncio.Socket,
                 address: str, warn_s: float) -> None:
        self.ctx, self.push, self.pull = ctx, push, pull
        self.address = address
        self.warn_s = warn_s
        self.next_step: int | None = None
        self.bytes_sent = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str, hwm: int = 2, warn_s: float = 30.0) -> AsyncIterator[BatchSender]:
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        pull = ctx.socket(zmq.PULL)
        try:
            push.setsockopt(zmq.SNDHWM, hwm)
            push.setsockopt(zmq.LINGER, 2000)
            pull.setsockopt(zmq.LINGER, 0)
            if address.startswith("ipc://"):
                Path(address.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)
            push.bind(address)
            bound = push.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port when address asked for port 0
            pull.bind(ckpt_address(bound))
            yield cls(ctx, push, pull, bound, warn_s)
        finally:
            push.close()
            pull.close()
            ctx.term()

    async def send(self, batch: Batch) -> None:
        """Send one step; waits (never drops) while the trainer is behind by ``hwm`` batches."""
        if self.next_step is not None and batch.step != self.next_step:
            raise DuplicateStep(f"refusing to send step {batch.step}: the next step is {self.next_step}")
        frames = encode(batch)
        waited = 0.0
        while True:
            try:
                await self.push.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:
                await asyncio.sleep(0.01)
                waited += 0.01
                if waited >= self.warn_s:
                    log.warning("trainer at %s has not taken step %d for %.0f s (send queue full); waiting",
                                self.address, batch.step, waited)
                    waited = 0.0
        self.next_step = batch.step + 1
        self.bytes_sent += sum(len(f) for f in frames)

    async def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[int]:
        """Checkpoint steps announced by the trainer (ZMQ, or marker files when ``marker_dir`` is set)."""
        if marker_dir is not None:
            seen = -1
            while True:
                names = await asyncio.to_thread(lambda: [p.stem for p in marker_dir.glob("step_*.ready")])
                steps = [int(n.removeprefix("step_")) for n in names if n.removeprefix("step_").isdigit()]
                for s in sorted(x for x in steps if x > seen):
                    seen = s
                    yield s
                await asyncio.sleep(0.1)
        while True:
            raw = await self.pull.recv()
            try:
                msg = msgpack.unpackb(raw, raw=False)
                yield int(msg["checkpoint"])
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                log.warning("ignored a malformed checkpoint announcement (%d bytes): %s", len(raw), e)


class BatchReceiver:
    """Trainer side. ``recv()`` returns the next valid batch; invalid messages are counted in ``rejected``."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None) -> None:
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.connect(address)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 1000)
        self.push.connect(ckpt_address(address))
        self.last_step: int | None = None
        self.rejected: dict[str, int] = {}

    async def recv(self) -> Batch:
        while True:
            frames = await self.pull.recv_multipart(copy=False)
            try:
                batch = decode(frames)
                if self.last_step is not None and batch.step != self.last_step + 1:
                    kind = "duplicate" if batch.step <= self.last_step else "out of order"
                    raise DuplicateStep(f"step {batch.step} is {kind}: the last step received was {self.last_step}")
            except WireError as e:
                key = type(e).__name__
                self.rejected[key] = self.rejected.get(key, 0) + 1
                log.error("rejected a batch: %s", e)
                continue
            self.last_step = batch.step
            return batch

    async def announce(self, step: int) -> None:
        """Tell the orchestrator that weights ``step`` are ready to load."""
        await self.push.send(msgpack.packb({"checkpoint": step}))

    def close(self) -> None:
        self.pull.close()
        self.push.close()


def write_marker(directory: Path, step: int) -> Path:
    """Announce a checkpoint with a marker file, written atomically (temp file, then rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"step_{step}.ready"
    tmp = directory / f".step_{step}.{os.getpid()}.tmp"
    tmp.write_bytes(b"")
    tmp.replace(path)
    return path


