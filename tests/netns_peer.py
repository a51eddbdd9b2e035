"""Processes for tests/test_netns_security.py, each run inside its own network namespace (host).

``python tests/netns_peer.py send ADDRESS --server-key FILE --authorized DIR --steps N``: the orchestrator's
side of the trainer link, a ``BatchSender`` with CURVE keys bound at ADDRESS. Prints JSON lines: ``{"bound"}``
once it listens (failed handshakes are watched from then on), ``{"refused": "push"|"pull", "why": EVENT}``
for each failed handshake, then sends steps 0..N-1 as soon as a trainer takes them, waits for their
acknowledgements and for the trainer's announcement of weights N, and prints ``{"done", "acked",
"skipped", "announced"}`` (every checkpoint step announced to it, in order) and exits 0.

``python tests/netns_peer.py intrude-workers ADDRESS [--server-key FILE --client-key FILE]``: the same at an
orchestrator's env-worker address: garbage over plain TCP, then a DEALER that says hello, ready, sends a
forged ``records`` message (reward FORGED_REWARD, token FORGED_TOKEN) for the first rollouts the
orchestrator names, a ``fatal`` and junk. Prints ``{"refused": [EVENT]}``, then ``{"received"}`` per message
it gets, until stdin says ``stop``: ``{"received_total": N}``.

``python tests/netns_peer.py intrude ADDRESS [--server-key FILE --client-key FILE]``: someone who must not
get in. Writes garbage to both ports over plain TCP, then connects ZMQ sockets like a trainer's (CURVE
with the given keys, else none) and sends a forged acknowledgement of step 50, a forged checkpoint 99 and
junk. Prints ``{"refused": [EVENT, EVENT]}`` once both its sockets have failed a handshake, then one
``{"received"}`` line per message it gets, until its stdin says ``stop`` (or closes): then
``{"received_total": N}`` and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt
import zmq
from zmq.utils.monitor import recv_monitor_message

from orchestrator.contracts.link import ckpt_address
from orchestrator.security import (
    HANDSHAKE_FAILED,
    ClientKeys,
    load_key_pair,
    load_public_key,
    load_server_keys,
    secure_client,
)
from orchestrator.testing.handshakes import FailedHandshakes, failed_handshakes
from orchestrator.transport import Batch, BatchSender

FORGED_HAVE = 50
FORGED_REWARD = 7.75
FORGED_TOKEN = 4242
FORGED_CHECKPOINT = 99
WAIT_S = 120.0  # a hang guard only: the other side is a process that may still be starting on a busy host


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def batch(step: int) -> Batch:
    tokens = np.arange(8, dtype=np.int32) + step
    chunks: dict[str, list[npt.NDArray[Any]]] = {
        "token_ids": [tokens], "loss_mask": [np.ones(8, np.uint8)], "logprobs": [np.zeros(8, np.float32)]}
    return Batch.from_columns("netns", step, chunks, [8], {"advantage": [1.0], "reward": [1.0], "env": ["e"]})


async def report(name: str, failures: FailedHandshakes) -> None:
    while True:
        with contextlib.suppress(TimeoutError):
            say(refused=name, why=await failures.next(3600))


async def send(address: str, server_key: str, authorized: str, steps: int) -> None:
    keys = load_server_keys(server_key, authorized)
    announced: list[int] = []
    async with BatchSender.open(address, hwm=2, warn_s=5.0, server_keys=keys) as sender:
        with failed_handshakes(sender.router) as to_push, failed_handshakes(sender.pull) as to_pull:
            async with asyncio.TaskGroup() as tg:
                watchers = [tg.create_task(report("push", to_push)), tg.create_task(report("pull", to_pull))]
                say(bound=sender.address)
                for step in range(steps):
                    await sender.send(batch(step))
                async with asyncio.timeout(WAIT_S):
                    await sender.wait_acked()
                    async for ckpt in sender.announcements():
                        announced.append(ckpt.step)
                        if ckpt.step == steps:
                            break
                for task in watchers:
                    task.cancel()
        say(done=True, acked=sender.acked, skipped=sender.skipped, announced=announced)


def raw_connection(address: str) -> socket.socket:
    """A plain TCP connection to ``tcp://HOST:PORT``, retried while nothing listens there yet (at most WAIT_S)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=WAIT_S)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def intrude_workers(address: str, keys: ClientKeys | None) -> None:
    from orchestrator.contracts.protocol import Fatal, Hello, Ready, Records, RolloutHeader, pack

    with raw_connection(address) as raw:
        raw.sendall(b"\xff" * 64 + bytes(range(256)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"rogue-1")
    if keys is not None:
        secure_client(dealer, keys)
    monitor = dealer.get_monitor_socket(HANDSHAKE_FAILED)
    dealer.connect(address)
    forged = [RolloutHeader(rid=f"g1-{i}", group="g1", env="orchestrator-arithmetic", task=0, policy_step=0,
                            worker="rogue-1", server="x", ok=True, reward=FORGED_REWARD, samples=[(2, 0, 0)],
                            tokens=2, frames=4) for i in range(2)]
    columns = [np.full(2, FORGED_TOKEN, np.int32).tobytes(), b"\x01\x01", np.zeros(2, np.float32).tobytes(), b""]
    for message in (Hello("local-0", 1), Ready("rogue-1", {"orchestrator-arithmetic": 1}),
                    Records("g1", forged), Fatal("rogue-1", "I say stop")):
        frames = [pack(message), *(columns * 2 if isinstance(message, Records) else [])]
        dealer.send_multipart(frames, flags=zmq.NOBLOCK)  # queued until a connection takes it (never)
    dealer.send(b"\xc1 junk", flags=zmq.NOBLOCK)
    if not monitor.poll(int(WAIT_S * 1000)):
        raise SystemExit(f"no failed handshake within {WAIT_S} s")
    say(refused=[zmq.Event(recv_monitor_message(monitor)["event"]).name])
    count_until_stopped(dealer, ctx)


def count_until_stopped(sock: zmq.Socket[bytes], ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Print a line per message ``sock`` receives until stdin says stop; then the total."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    received = 0
    try:
        while True:
            ready = dict(poller.poll())
            if sock in ready:
                frames = sock.recv_multipart()
                received += 1
                say(received=len(frames))
            if sys.stdin.fileno() in ready and sys.stdin.readline().strip() in ("stop", ""):
                break
    finally:
        say(received_total=received)
        ctx.destroy(linger=0)


def intrude(address: str, keys: ClientKeys | None) -> None:
    for target in (address, ckpt_address(address)):
        with raw_connection(target) as raw:
            raw.sendall(b"\xff" * 64 + b"GET / HTTP/1.0\r\n\r\n" + bytes(range(256)))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)  # as a trainer's receiver connects
    pull.setsockopt(zmq.ROUTING_ID, b"intruder")
    monitors = []
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            secure_client(sock, keys)
        monitors.append(sock.get_monitor_socket(HANDSHAKE_FAILED))
    pull.connect(address)
    push.connect(ckpt_address(address))
    for message in ({"have": FORGED_HAVE, "hello": True, "id": "intruder"},
                    {"checkpoint": FORGED_CHECKPOINT, "have": -1, "id": "intruder"}):
        push.send(msgpack.packb(message), flags=zmq.NOBLOCK)  # queued until a connection takes it (never)
    push.send(b"\xc1 junk", flags=zmq.NOBLOCK)
    whys = []
    for monitor in monitors:  # each socket tried, and was refused
        if not monitor.poll(int(WAIT_S * 1000)):
            raise SystemExit(f"no failed handshake within {WAIT_S} s")
        whys.append(zmq.Event(recv_monitor_message(monitor)["event"]).name)
    say(refused=whys)
    count_until_stopped(pull, ctx)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["send", "intrude", "intrude-workers"])
    p.add_argument("address")
    p.add_argument("--server-key", default=None)
    p.add_argument("--client-key", default=None)
    p.add_argument("--authorized", default=None)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    if args.mode == "send":
        asyncio.run(send(args.address, args.server_key, args.authorized, args.steps))
    else:
        keys = None
        if args.client_key is not None:
            keys = ClientKeys(load_public_key(args.server_key), load_key_pair(args.client_key))
        (intrude_workers if args.mode == "intrude-workers" else intrude)(args.address, keys)


if __name__ == "__main__":
    main()
