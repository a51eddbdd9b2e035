"""Across nodes: an env worker serves spans of its column pool over ZMQ; the trainer library fetches them.

docs/data-plane.md, "Across nodes"; the messages are in docs/wire-format.md, "Column fetch".
``SpanServer.open(pool, address, keys=None)`` binds a ROUTER at ``address`` and answers each
request with the bytes of the spans it names, one frame per span, sent without a copy from the pool's memory
(a span is never reused under a send: the orchestrator releases it only after the trainer has acknowledged the
step, which it does after the fetch). ``SpanClient.fetch(address, pool_id, spans, timeout_s, keys=None)`` (blocking:
call it off an event loop) sends one request on its connection to that server and returns the frames' buffers
(``fetch_spans``: the same on a connection of its own), or raises a
``WireError`` naming what went wrong: no answer within ``timeout_s`` (the worker is gone or unreachable, or its
key is not the one expected), a pool that is not the worker's current one, a span outside the pool, a reply of
the wrong shape.

Messages (msgpack maps): request ``{"req": N, "pool": ID, "spans": [[offset, nbytes], ...]}`` (at most
MAX_FETCH_SPANS spans, MAX_REQUEST_BYTES bytes); reply ``[{"req": N, "ok": true}, span bytes...]`` or
``[{"req": N, "ok": false, "why": STR}]``. With ``keys`` (``ServerKeys``: the worker's key pair and the
trainers' authorized public keys; a client gives ``ClientKeys`` naming the worker's public key) both ends are
CURVE (``orchestrator.security``): only authorized trainers connect, and the bytes are encrypted.

Bounds: the server's replies never wait: a reply its high-water mark (``hwm`` messages per peer) cannot take now
is dropped and counted (``dropped``), and that trainer's fetch times out; a fetch holds one reply in memory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import msgpack
import zmq
import zmq.asyncio

from orchestrator.background import background
from orchestrator.errors import WireError
from orchestrator.security import ClientKeys, ServerKeys, curve_server, secure_client

log = logging.getLogger(__name__)

MAX_FETCH_SPANS = 1 << 16
MAX_REQUEST_BYTES = 4 << 20
SPAN_FETCH_TIMEOUT_S = 30.0  # the trainer library's default bound on one pool's fetch for a step (fetch_timeout_s)


class ServedPool(Protocol):
    """What a span server reads: the pool's current id and its bytes (``columns.store.ColumnStore``)."""

    @property
    def id(self) -> str: ...

    def buffer(self) -> memoryview: ...


class SpanServer:
    """See the module docstring. ``served``, ``refused``, ``dropped``: requests answered with bytes, answered
    with a refusal, and replies dropped at the high-water mark."""

    def __init__(self, sock: zmq.asyncio.Socket, pool: ServedPool) -> None:
        self.sock, self.pool = sock, pool
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.served = self.refused = self.dropped = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, pool: ServedPool, address: str, keys: ServerKeys | None = None, hwm: int = 64
                   ) -> AsyncIterator[SpanServer]:
        """Bind and serve until the block ends (``address``: tcp://HOST:0 asks for any port; ``server.address``
        says which)."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            with contextlib.ExitStack() as auth:
                if keys is not None:
                    auth.enter_context(curve_server(ctx, keys)).secure(sock)
                sock.setsockopt(zmq.SNDHWM, hwm)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply is an error we count, not a loss
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
                sock.bind(address)
                server = cls(sock, pool)
                try:
                    async with background(("span-server", server.run())):
                        yield server
                finally:
                    sock.close()
        finally:
            sock.close()
            ctx.term()

    async def run(self) -> None:
        """Consumes fetch requests; produces replies (span bytes, or a refusal). Wakes on each request."""
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) != 2:
                continue  # not a request of ours: nothing to answer
            ident, raw = frames
            try:
                req, reply = self._answer(raw)
            except ValueError as e:  # no request id to answer to
                log.warning("ignored a malformed span request: %s", e)
                continue
            try:
                self.sock.send_multipart([ident, msgpack.packb(req), *reply], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.dropped += 1
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                self.dropped += 1

    def _answer(self, raw: bytes) -> tuple[dict[str, Any], list[Any]]:
        """(reply header, span buffers) for one request; ValueError if it has no request id."""
        try:
            msg = msgpack.unpackb(raw, raw=False)
            req = msg["req"]
            if not isinstance(req, int):
                raise TypeError(f"req must be an int, got {req!r}")
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise ValueError(str(e)) from None
        try:
            spans = self._spans(msg)
        except (ValueError, KeyError, TypeError) as e:
            self.refused += 1
            return {"req": req, "ok": False, "why": str(e)}, []
        buf = self.pool.buffer()
        self.served += 1
        return {"req": req, "ok": True}, [buf[offset:offset + nbytes] for offset, nbytes in spans]

    def _spans(self, msg: dict[str, Any]) -> list[tuple[int, int]]:
        if msg["pool"] != self.pool.id:
            raise ValueError(f"pool {msg['pool']!r} is not served here: this worker's pool is {self.pool.id}")
        raw = msg["spans"]
        if not isinstance(raw, list) or len(raw) > MAX_FETCH_SPANS:
            raise ValueError(f"spans must be a list of at most {MAX_FETCH_SPANS} [offset, nbytes] pairs")
        size = len(self.pool.buffer())
        out = []
        for pair in raw:
            offset, nbytes = pair
            if not (isinstance(offset, int) and isinstance(nbytes, int) and offset >= 0
                    and 0 <= nbytes <= size - offset):
                raise ValueError(f"span {pair!r} is not inside pool {self.pool.id} ({size} bytes)")
            out.append((offset, nbytes))
        return out


class SpanClient:
    """Blocking fetches (call them off an event loop) from span servers, over one DEALER per server (address and
    public key) kept open from one fetch to the next: a fresh TCP connection per step would pay its handshakes
    (CURVE's too) and start with a cold window every time. A socket whose fetch failed in any way is closed, so
    a late reply can never answer a later request; the next fetch from that server connects again. At most
    ``max_connections`` are kept, the least recently used closed first (a restarted worker's server has a new
    port: its old one is never asked again)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]] | None = None, max_connections: int = 256) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.max_connections = max_connections
        self._socks: dict[tuple[str, bytes | None], zmq.Socket[bytes]] = {}  # least recently used first

    def fetch(self, address: str, pool_id: str, spans: Sequence[tuple[int, int]], timeout_s: float,
              keys: ClientKeys | None = None) -> list[memoryview]:
        """At most ``timeout_s``: the bytes of ``spans`` (offset, nbytes) of pool ``pool_id`` from the span server
        at ``address`` (see the module docstring); WireError naming the problem."""
        key = (address, None if keys is None else keys.server_public)
        sock = self._socks.pop(key, None)
        try:
            if sock is None:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if keys is not None:
                    secure_client(sock, keys)
                sock.connect(address)
            bufs = _request(sock, address, pool_id, spans, timeout_s)
        except zmq.ZMQError as e:  # an address or key the worker announced that zmq cannot use
            if sock is not None:
                sock.close()
            raise WireError(f"pool {pool_id}: cannot fetch from the span server at {address!r}: {e}") from None
        except BaseException:
            if sock is not None:
                sock.close()
            raise
        self._socks[key] = sock
        while len(self._socks) > self.max_connections:
            self._socks.pop(next(iter(self._socks))).close()
        return bufs

    @property
    def connections(self) -> int:
        """Span servers this client holds a connection to."""
        return len(self._socks)

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


def fetch_spans(address: str, pool_id: str, spans: Sequence[tuple[int, int]], timeout_s: float,
                keys: ClientKeys | None = None, ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> list[memoryview]:
    """One ``SpanClient.fetch`` on a connection of its own, closed after it."""
    client = SpanClient(ctx)
    try:
        return client.fetch(address, pool_id, spans, timeout_s, keys)
    finally:
        client.close()


def _request(sock: zmq.Socket[bytes], address: str, pool_id: str, spans: Sequence[tuple[int, int]],
             timeout_s: float) -> list[memoryview]:
    """One request on ``sock`` and its reply, all within ``timeout_s``: the send is bounded too, since a DEALER
    with no pipe to its server (a refused handshake being retried) blocks its sender until one comes back, which
    hung a fetch with a key the server does not accept, once, under load."""
    req = secrets.randbits(31)  # pairs the reply with this request
    deadline = time.monotonic() + timeout_s
    sock.setsockopt(zmq.SNDTIMEO, max(int(timeout_s * 1000), 1))
    try:
        sock.send(msgpack.packb({"req": req, "pool": pool_id, "spans": [list(s) for s in spans]}))
    except zmq.Again:
        raise WireError(f"pool {pool_id}: no answer from the span server at {address} within {timeout_s} s (no "
                        "connection took the request: its worker gone or unreachable, or not the key expected)"
                        ) from None
    if not sock.poll(max(int((deadline - time.monotonic()) * 1000), 0)):
        raise WireError(f"pool {pool_id}: no answer from the span server at {address} within {timeout_s} s "
                        "(its worker gone or unreachable, or not the key expected)")
    frames = sock.recv_multipart(copy=False)
    try:
        head = msgpack.unpackb(frames[0].bytes, raw=False)
        ok, got = head["ok"], head["req"]
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
        raise WireError(f"pool {pool_id}: a malformed reply from {address}: {e}") from None
    if got != req:
        raise WireError(f"pool {pool_id}: {address} answered request {got!r}, not {req}")
    if not ok:
        raise WireError(f"pool {pool_id}: {address} refused the fetch: {head.get('why')}")
    bufs = [f.buffer for f in frames[1:]]
    if [len(b) for b in bufs] != [n for _, n in spans]:
        raise WireError(f"pool {pool_id}: {address} sent {len(bufs)} spans of sizes {[len(b) for b in bufs][:8]}, "
                        f"expected {[n for _, n in spans][:8]}")
    return bufs
