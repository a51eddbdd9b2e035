"""Watching a ZMQ socket's failed handshakes, so a test can wait until a peer has been refused (an event)
instead of sleeping and hoping it was."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from orchestrator.security import HANDSHAKE_FAILED


class FailedHandshakes:
    """The failed handshakes of one socket, in order (read from its ZMQ monitor on the running loop)."""

    def __init__(self, monitor: zmq.asyncio.Socket) -> None:
        self._monitor = monitor

    async def next(self, timeout_s: float = 10.0) -> str:
        """The next failure's event name (e.g. ``HANDSHAKE_FAILED_AUTH``); TimeoutError after ``timeout_s``."""
        if not await self._monitor.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no failed handshake within {timeout_s} s")
        event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
        return zmq.Event(event).name or str(event)


@contextlib.contextmanager
def failed_handshakes(sock: zmq.Socket[Any]) -> Iterator[FailedHandshakes]:
    """Watch ``sock`` (plain or asyncio) for failed handshakes from now on; the monitor goes on exit."""
    address = f"inproc://failed-handshakes.{uuid.uuid4().hex}"  # not id(sock): security.RefusalWatch says why
    sock.monitor(address, HANDSHAKE_FAILED)
    monitor = zmq.asyncio.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    try:
        monitor.connect(address)
        yield FailedHandshakes(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
