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

``serve_pool(pool, path)`` hands the memfd to whoever connects to the Unix socket ``path`` (the batch
address plus ``.shm``): one message ``{"id", "size"}`` (msgpack) with the fd attached (``SCM_RIGHTS``).

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
import fcntl
import logging
import mmap
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from orchestrator.errors import TransportError, WireError
from orchestrator.transport.wire import Batch, encode, encode_shm_header, shm_layout

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 5.0  # a receiver's wait for the pool's fd (a local socket; the sender just sent a header)
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


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
        if capacity_bytes < 1:
            raise TransportError(f"a shared-memory pool needs at least one byte, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.warn_s = warn_s
        self.id = f"{os.getpid()}-{secrets.token_hex(8)}"  # a new pool (restart) gets a new id
        self.inline_steps = 0  # batches too large for the pool, sent as frames
        self.fd = os.memfd_create("orchestrator-batches", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, capacity_bytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # receivers may rely on the size: no SIGBUS
            self._map = mmap.mmap(self.fd, capacity_bytes)
        except OSError as e:
            os.close(self.fd)
            raise TransportError(f"cannot create a {capacity_bytes}-byte shared-memory pool: {e}") from None
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
            await asyncio.shield(copy)  # a cancelled send frees the span only once the thread stops writing
        except BaseException:
            copy.add_done_callback(lambda _f: self.drop(batch.step))
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
        t0 = warned = time.monotonic()
        while (start := self._ring.place(step, nbytes)) is None:
            self._released.clear()
            try:  # a release that frees too little does not restart the warning's count
                async with asyncio.timeout(max(warned + self.warn_s - time.monotonic(), 0.0)):
                    await self._released.wait()
            except TimeoutError:
                warned = time.monotonic()
                log.warning("step %d waits for %d MB of the shared-memory pool: %d MB held by %d unreleased "
                            "steps (%.0f s so far)", step, nbytes >> 20, self.live_bytes >> 20, self.spans,
                            time.monotonic() - t0)
        return start

    def _write(self, columns: dict[str, np.ndarray], at: dict[str, tuple[int, int]]) -> None:
        """Blocking (a worker thread): the one copy of the column bytes."""
        for name, col in columns.items():
            start, n = at[name]
            self._bytes[start:start + n] = col.reshape(-1).view(np.uint8)

    def close(self) -> None:
        del self._bytes
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            log.warning("shared-memory pool still viewed at close; it is unmapped when the view goes")
        os.close(self.fd)


@contextlib.asynccontextmanager
async def serve_pool(pool: ShmPool, path: str) -> AsyncIterator[str]:
    """Hand ``pool``'s fd to every process that connects to the Unix socket ``path`` (replacing a stale socket
    file), from a task this context owns; the socket file is removed on exit."""
    listener = _listen(path)
    server = asyncio.create_task(_serve(pool, listener, path), name="shm-pool-server")
    try:
        yield path
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        listener.close()
        _unlink(path)


def _listen(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _unlink(path)  # a SIGKILLed sender's socket file (ZMQ, binding the batch address, does the same)
        listener.bind(path)
        listener.listen(16)
        listener.setblocking(False)
    except OSError as e:
        listener.close()
        raise TransportError(f"cannot serve the shared-memory pool at {path}: {e}") from None
    return listener


def _unlink(path: str) -> None:
    Path(path).unlink(missing_ok=True)


async def _serve(pool: ShmPool, listener: socket.socket, path: str) -> None:
    """Consumes connections on ``path``; produces one message with the pool's fd on each. Runs until cancelled."""
    loop = asyncio.get_running_loop()
    message = msgpack.packb({"id": pool.id, "size": pool.capacity})
    while True:
        try:
            conn, _ = await loop.sock_accept(listener)
        except OSError as e:  # e.g. out of fds: a receiver retries on its next batch
            log.warning("shared-memory pool socket %s: accept failed: %s", path, e)
            await asyncio.sleep(0.1)
            continue
        with conn:
            try:  # a few bytes into a fresh local socket's empty buffer: never blocks
                socket.send_fds(conn, [message], [pool.fd])
            except OSError as e:
                log.warning("could not hand the shared-memory pool to a receiver on %s: %s", path, e)


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
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(FETCH_TIMEOUT_S)
                s.connect(path)
                raw, fds, _flags, _addr = socket.recv_fds(s, 1024, 1)
        except OSError as e:
            raise WireError(f"cannot fetch shared-memory pool {pool_id} from {path}: {e}") from None
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise WireError(f"{path} sent {len(fds)} file descriptors, expected the pool's one")
        fd = fds[0]
        try:
            meta = msgpack.unpackb(raw, raw=False)
            if meta.get("id") != pool_id or meta.get("size") != size:
                raise WireError(f"{path} serves pool {meta.get('id')} ({meta.get('size')} bytes), the header "
                                f"names {pool_id} ({size} bytes): a sender restarted in between?")
            if os.fstat(fd).st_size != size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SEALS != _SEALS:
                raise WireError(f"pool {pool_id} from {path} is not a sealed {size}-byte memfd")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (ValueError, AttributeError, TypeError, OSError, msgpack.UnpackException) as e:
            raise WireError(f"bad shared-memory pool from {path}: {e}") from None
        finally:
            os.close(fd)  # the mapping keeps the memory alive
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
