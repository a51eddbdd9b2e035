"""The orchestrator's end of the ZMQ trainer link as raw sockets, for tests that send what no ``BatchSender`` would.

``raw_link(address)`` binds a ROUTER at ``address`` and a PULL on its trainer channel, as ``BatchSender`` does,
and yields a ``RawLink``: ``send(peer, frames)`` routes one message to the receiver whose ``id`` is ``peer``
(waiting, up to a hang guard, until its DEALER has connected), ``report()`` reads what receivers sent back.
"""

from __future__ import annotations

import contextlib
import errno
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from orchestrator.contracts.link import ckpt_address
from orchestrator.contracts.reports import TrainerReport, decode_report

CONNECT_TIMEOUT_S = 30.0  # a hang guard: a local receiver connects in milliseconds


@dataclass
class RawLink:
    router: zmq.Socket[bytes]
    pull: zmq.Socket[bytes]
    address: str

    def send(self, peer: str, frames: Sequence[Any]) -> None:
        """Route ``frames`` to receiver ``peer`` (its ``id``) once it is connected; AssertionError if it never is."""
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while True:
            try:
                self.router.send_multipart([peer.encode(), *frames])
                return
            except zmq.ZMQError as e:
                if e.errno != errno.EHOSTUNREACH:
                    raise
                assert time.monotonic() < deadline, f"receiver {peer} did not connect to {self.address}"
                time.sleep(0.005)

    def report(self, timeout_s: float = 5.0) -> TrainerReport:
        """The next message a receiver sent back, decoded as the orchestrator does (AssertionError after
        ``timeout_s``; WireError for one the orchestrator would ignore)."""
        assert self.pull.poll(int(timeout_s * 1000)), f"no message from a receiver within {timeout_s} s"
        return decode_report(self.pull.recv())


@contextlib.contextmanager
def raw_link(address: str) -> Iterator[RawLink]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    for s in (router, pull):
        s.setsockopt(zmq.LINGER, 0)
    try:
        router.bind(address)
        pull.bind(ckpt_address(address))
        yield RawLink(router, pull, address)
    finally:
        router.close()
        pull.close()
        ctx.term()
