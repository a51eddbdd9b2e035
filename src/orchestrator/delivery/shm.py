"""Same-node transport: a step's columns go through one bounded shared-memory pool, the header over ZMQ.

Sender side, ``ShmPool(capacity_bytes)``: one anonymous ``memfd`` of that size (sealed against shrinking
and growing), mapped read-write by the orchestrator. Each step takes one contiguous span of it (all its
columns, each ``SHM_ALIGN``-aligned), allocated from a ring: spans are freed in step order when the
trainer acknowledges the step (``BatchSender.on_ack``), and new spans reuse that space. ``frames(batch)``
waits (asynchronously, warning every ``warn_s``) while the span does not fit, copies the columns into it
in a worker thread (the one copy) and returns the one-frame header (``encode_shm_header``) that says
where the columns are. A batch larger than the whole pool cannot ever fit: it is sent as ordinary column
frames instead, with a warning, and counted in ``inline_steps``. The bound: at most ``capacity_bytes``
of column data are in the pool, and at most ``send_hwm`` steps (the sender's window).

``serve_pool(pool, path)`` (memfd.py) hands the memfd, read-only, to whoever connects to the Unix socket
``path`` (the batch address plus ``.shm``): one message ``{"id", "size"}`` (msgpack) with the fd attached
(``SCM_RIGHTS``).

Receiver side, ``ShmAttachment(address)``: a header naming a pool it does not map (first batch, or an
orchestrator restarted with a new pool) raises ``PoolNotMapped`` from ``region``; the receiver then calls
``fetch`` (blocking, briefly: off the loop in an asyncio receiver, as the sender may share that loop), which
gets the fd, checks its id, size and seals, maps it read-only and closes the fd, and decodes again:
``decode`` returns numpy views of the mapping.

No name ever exists in ``/dev/shm``: a memfd is freed by the kernel when the last process holding it
(fd or mapping) goes, however it goes, SIGKILL included. A receiver's mapping stays valid after the
sender dies, until the receiver drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from orchestrator.columns.memfd import FETCH_TIMEOUT_S, SealedMemfd, map_served_pool, serve_pool
from orchestrator.contracts.wire import Batch, encode, encode_shm_header, shm_layout
from orchestrator.errors import TransportError, WireError

__all__ = ["FETCH_TIMEOUT_S", "PoolNotMapped", "ShmAttachment", "ShmPool", "SpanRing", "pool_socket_path",
           "serve_pool"]

log = logging.getLogger(__name__)


def pool_socket_path(address: str) -> str:
    """The Unix socket that serves the pool's fd, next to an ``ipc://`` batch address."""
    if not address.startswith("ipc://"):
        raise TransportError(f"shared memory needs an ipc:// batch address (same node), got {address!r}")
    return address.removeprefix("ipc://") + ".shm"


class PoolNotMapped(Exception):  # internal: a request to fetch, always caught by the receivers
    """Raised by ``ShmAttachment.region`` for a pool it does not map yet: call ``fetch(pool_id, size)``."""

    def __init__(self, pool_id: str, size: int) -> None:
        super().__init__(f"shared-memory pool {pool_id} ({size} bytes) is not mapped")
        self.pool_id, self.size = pool_id, size


@dataclass
class _Span:
    step: int
    start: int
    end: int
    dropped: bool = False  # freed out of order (a send cancelled mid-copy); popped when it reaches an end


class SpanRing:
    """Contiguous spans of ``capacity`` bytes, allocated in step order and freed oldest first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._spans: deque[_Span] = deque()

    def __len__(self) -> int:
        return len(self._spans)

    @property
    def live_bytes(self) -> int:
        return sum(s.end - s.start for s in self._spans)

    def place(self, step: int, nbytes: int) -> int | None:
        """The start of a new span of ``nbytes`` for ``step``, or None while the free space does not fit it."""
        if nbytes > self.capacity:
            return None
        if not self._spans:
            start: int | None = 0
        else:
            first, last = self._spans[0], self._spans[-1]
            if last.start >= first.start:  # not wrapped: free are [last.end, capacity) and [0, first.start)
                start = last.end if last.end + nbytes <= self.capacity else 0 if nbytes <= first.start else None
            else:  # wrapped: free is [last.end, first.start)
                start = last.end if last.end + nbytes <= first.start else None
        if start is not None:
            self._spans.append(_Span(step, start, start + nbytes))
        return start

    def release_through(self, step: int) -> None:
        """Free the spans of every step <= ``step``."""
        while self._spans and (self._spans[0].step <= step or self._spans[0].dropped):
            self._spans.popleft()

    def drop(self, step: int) -> None:
        """Free ``step``'s span out of order (its batch was never sent)."""
        for s in self._spans:
            if s.step == step:
                s.dropped = True
        while self._spans and self._spans[-1].dropped:
            self._spans.pop()
        while self._spans and self._spans[0].dropped:
            self._spans.popleft()


class ShmPool:
    """The sender's pool (see the module docstring): ``frames(batch)`` -> the header frame of a shared-memory
    batch; ``release_through(step)`` when the trainer acknowledges; ``close()`` at the end."""

    def __init__(self, capacity_bytes: int, warn_s: float = 30.0) -> None:
        self.capacity = capacity_bytes
        self.warn_s = warn_s
        self.id = f"{os.getpid()}-{secrets.token_hex(8)}"  # a new pool (restart) gets a new id
        self.inline_steps = 0  # batches too large for the pool, sent as frames
        self._memfd = SealedMemfd("orchestrator-batches", capacity_bytes)  # receivers rely on the size: no SIGBUS
        self.fd = self._memfd.fd
        self._map = self._memfd.map
        self._bytes = np.frombuffer(self._map, np.uint8)
        self._ring = SpanRing(capacity_bytes)
        self._released = asyncio.Event()

    @property
    def live_bytes(self) -> int:
        """Bytes held by steps not yet acknowledged."""
        return self._ring.live_bytes

    @property
    def spans(self) -> int:
        """Steps holding a span."""
        return len(self._ring)

    def metrics(self) -> dict[str, Any]:
        return {"shm_live_mb": round(self.live_bytes / 2**20, 2), "shm_spans": self.spans,
                "shm_inline_steps": self.inline_steps}

    async def frames(self, batch: Batch) -> list[Any]:
        """The message for ``batch``: its columns copied into a new span (in a worker thread), then the header
        saying where. Waits while the span does not fit; a batch larger than the pool goes as frames."""
        columns = {name: np.ascontiguousarray(col) for name, col in batch.columns.items()}
        layout, nbytes = shm_layout(columns)
        if nbytes > self.capacity:
            self.inline_steps += 1
            log.warning("step %d: its %d MB of columns exceed the %d MB shared-memory pool "
                        "(transport.shm_pool_mb); sent as ZMQ frames instead", batch.step, nbytes >> 20,
                        self.capacity >> 20)
            return encode(batch)
        start = await self._allocate(batch.step, nbytes)
        at = {name: (start + off, n) for name, (off, n) in layout.items()}
        copy = asyncio.ensure_future(asyncio.to_thread(self._write, columns, at))
        try:
            await asyncio.shield(copy)
        except BaseException:
            # a thread cannot be stopped: a cancelled send waits for its copy (one memcpy of the batch) and frees
            # the span only once the thread stops writing; no task outlives this call
            await _finished(copy)
            self.drop(batch.step)
            raise
        return [encode_shm_header(batch, columns, at, self.id, self.capacity)]

    def release_through(self, step: int) -> None:
        """The trainer released every step <= ``step``: their spans are free for new steps."""
        self._ring.release_through(step)
        self._released.set()

    def drop(self, step: int) -> None:
        """``step`` was not sent after all: its span is free."""
        self._ring.drop(step)
        self._released.set()

    async def _allocate(self, step: int, nbytes: int) -> int:
        loop = asyncio.get_running_loop()
        t0 = warned = loop.time()
        while (start := self._ring.place(step, nbytes)) is None:
            self._released.clear()
            try:  # a release that frees too little does not restart the warning's count
                async with asyncio.timeout(max(warned + self.warn_s - loop.time(), 0.0)):
                    await self._released.wait()
            except TimeoutError:
                warned = loop.time()
                log.warning("step %d waits for %d MB of the shared-memory pool: %d MB held by %d unreleased "
                            "steps (%.0f s so far)", step, nbytes >> 20, self.live_bytes >> 20, self.spans,
                            warned - t0)
        return start

    def _write(self, columns: dict[str, np.ndarray], at: dict[str, tuple[int, int]]) -> None:
        """Blocking (a worker thread): the one copy of the column bytes."""
        for name, col in columns.items():
            start, n = at[name]
            self._bytes[start:start + n] = col.reshape(-1).view(np.uint8)

    def close(self) -> None:
        del self._bytes
        self._memfd.close()


class ShmAttachment:
    """Receiver side: the sender's pool mapped read-only, fetched from the socket next to ``address`` when
    a header names a pool not mapped yet. ``region`` is the ``ShmResolver`` for ``decode``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.pool_id: str | None = None
        self.fetches = 0  # how many times a pool was fetched (1, plus one per sender restart)
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None

    @property
    def mapping(self) -> memoryview | None:
        """The read-only mapping batches view now (None before the first shared-memory batch)."""
        return self._view

    def region(self, pool_id: str, size: int) -> memoryview:
        """The mapping of ``pool_id``; PoolNotMapped if it is not the pool mapped now."""
        if pool_id != self.pool_id or self._view is None:
            raise PoolNotMapped(pool_id, size)
        if len(self._view) != size:
            raise WireError(f"header says pool {pool_id} has {size} bytes, the mapping has {len(self._view)}")
        return self._view

    def fetch(self, pool_id: str, size: int) -> None:
        """Blocking, briefly (a local socket, at most FETCH_TIMEOUT_S): the fd, checked, mapped, closed."""
        try:
            path = pool_socket_path(self.address)
        except TransportError as e:
            raise WireError(str(e)) from None
        mapping = map_served_pool(path, pool_id, size)
        self._drop()
        self._map, self._view, self.pool_id = mapping, memoryview(mapping), pool_id
        self.fetches += 1
        log.info("mapped shared-memory pool %s (%d MB) from %s", pool_id, size >> 20, path)

    def _drop(self) -> None:
        """Forget the mapping; it is unmapped now, or when the last batch viewing it goes."""
        if self._view is not None:
            self._view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # batches still view it: it stays mapped until they go
                pass
        self._map, self._view, self.pool_id = None, None, None

    def close(self) -> None:
        self._drop()


async def _finished(fut: asyncio.Future[None]) -> None:
    """Wait until ``fut`` is done, through further cancellations (the caller re-raises its own exception); an
    error ``fut`` ends with meanwhile is logged (one it had already is what the caller raises)."""
    if fut.done():
        return
    while not fut.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({fut})
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("copying a batch into the shared-memory pool failed: %s", fut.exception())
