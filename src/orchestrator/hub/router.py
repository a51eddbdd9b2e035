"""The hub's socket: one ZMQ ROUTER the env workers connect to.

``bind`` binds it (a CURVE server when given server keys: only their authorized clients get in; over ipc://
whoever may open the socket file) and closes it, its authenticator and its context on exit. ``Router`` reads it
from a loop reader callback while ``reading`` and sends on it without waiting.

Per-rollout cost on the loop is what limits how many workers one orchestrator feeds, so the socket is a plain
(sync) ZMQ socket read from a loop reader callback that drains up to DRAIN_MAX messages per wake-up (no future
per message), sends never wait (NOBLOCK), and messages are handed on as frames: column frames stay zero-copy
buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

import zmq

from orchestrator import ipc
from orchestrator.contracts.protocol import pack
from orchestrator.errors import TransportError
from orchestrator.security import LOCAL_KEYS_ENV, ServerKeys, curve_server

log = logging.getLogger(__name__)

DRAIN_MAX = 16  # messages handled per reader wake-up before other callbacks get the loop
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)  # plain ints: no enum cost

Handler = Callable[[bytes, list[Any]], None]  # (a worker's identity, its message's frames)


@contextlib.contextmanager
def bind(address: str, server_keys: ServerKeys | None) -> Iterator[tuple[zmq.Socket[bytes], dict[str, str]]]:
    """A ROUTER bound at ``address``, and the environment local workers need to connect to it: with
    ``server_keys``, a key pair made for the run (never on disk), which the authenticator lets in."""
    ctx = zmq.Context()
    env: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        stack.callback(ctx.term)  # last: after the authenticator stopped and the socket closed
        sock = ctx.socket(zmq.ROUTER)
        if server_keys is not None:
            public, secret = zmq.curve_keypair()
            server_keys = dataclasses.replace(server_keys, authorized=server_keys.authorized | {public})
            stack.enter_context(curve_server(ctx, server_keys)).secure(sock)
            env.update(zip(LOCAL_KEYS_ENV, (server_keys.keys.public.decode(), public.decode(), secret.decode()),
                           strict=True))
        stack.callback(sock.close)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            ipc.prepare(address)
            sock.bind(address)
        except zmq.ZMQError as e:
            raise TransportError(f"cannot bind the env workers' address {address}: {e}") from None
        stack.callback(ipc.remove, address)  # libzmq leaves the file (orchestrator.ipc); after sock.close
        yield sock, env


class Router:
    """Reads the bound socket (``reading``), handing each message to ``handle``, and sends on it (``send``).
    ``handle`` must not raise: one that does is counted (``metrics["rejected:internal_error"]``) and logged, and
    the drain goes on; ``metrics["messages"]`` counts every message."""

    def __init__(self, sock: zmq.Socket[bytes], handle: Handler, metrics: Counter[str]) -> None:
        self.sock = sock
        self._handle = handle
        self.metrics = metrics
        self._until: asyncio.Future[None] | None = None  # set while reading: the run it reads for

    @contextlib.contextmanager
    def reading(self, until: asyncio.Future[None]) -> Iterator[None]:
        """Read messages from a loop reader callback until ``until`` is done or the block exits."""
        loop = asyncio.get_running_loop()
        self._until = until
        fd = self.sock.fileno()
        loop.add_reader(fd, self._drain)
        try:
            loop.call_soon(self._drain)  # messages queued before the reader was registered
            yield
        finally:
            loop.remove_reader(fd)
            self._until = None  # the reader's callbacks are this run's: a _drain still scheduled does nothing

    def _drain(self) -> None:
        """Handle queued messages. ZMQ's fd is edge-triggered: read until EVENTS has no POLLIN, in slices of
        DRAIN_MAX so a flood cannot hold the loop. Never raises: a message is handled or rejected."""
        for _ in range(DRAIN_MAX):
            if self._until is None or self._until.done() or not cast(int, self.sock.getsockopt(_EVENTS)) & _POLLIN:
                return
            try:
                ident, *frames = self.sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.metrics["messages"] += 1
            try:
                self._handle(ident.bytes, frames)
            except Exception:  # a bug here must not stop the hub, nor skip the rest of the drain
                self.metrics["rejected:internal_error"] += 1
                log.exception("internal error handling a message from worker %r", ident.bytes[:64])
        asyncio.get_running_loop().call_soon(self._drain)

    def send(self, ident: bytes, msg: Any) -> bool:
        """Send without waiting; False (and a warning) when the worker is gone or not keeping up."""
        try:
            self.sock.send_multipart([ident, pack(msg)], _NOBLOCK)
        except zmq.ZMQError as e:  # gone or its queue is full: supervision deals with its rollouts
            log.warning("could not reach env worker %r: %s", ident[:64], e)
            return False
        finally:  # a send can swallow the fd's edge for messages that arrived meanwhile
            if self._until is not None:
                asyncio.get_running_loop().call_soon(self._drain)
        return True
