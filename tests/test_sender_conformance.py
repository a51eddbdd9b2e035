"""One conformance suite, run against every sender kind (as trio checks every stream with ``check_one_way_stream``).

Each kind comes with a trainer end that does what that kind's trainer does (``BatchReceiver`` for zmq and shm,
``FileBatchReceiver`` for files, prime-rl's ranks and broadcasts for both prime-rl layouts), over real sockets
and files. ``zmq-direct`` is the data plane's link: each step's columns go into an env worker's column pool
(``ColumnStore``, served on its socket) and the sender sends the step manifest; the trainer end maps the pool.

Every scenario checks the same promises: every step reaches the trainer once and in order; at the bound the
sender waits (nothing is dropped) until the trainer acknowledges; a restarted trainer, resuming from what it
acknowledged, gets the rest; a restarted sender skips what the trainer already has.

A step is told apart by its content (its one sample's first token is 1000 + step), since prime-rl's messages
carry no step number.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from orchestrator.columns.memfd import serve_pool
from orchestrator.columns.samples import Sample
from orchestrator.columns.store import ColumnStore, rollout_layout
from orchestrator.contracts.manifest import build_manifest
from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord
from orchestrator.delivery.primerl import Layout
from orchestrator.testing.primerl import FakePrimeRLTrainer
from orchestrator.testing.procs import wait_until
from orchestrator.transport import (
    Batch,
    BatchReceiver,
    BatchSender,
    FileBatchReceiver,
    FileBatchSender,
    PrimeRLSender,
    Sender,
)

TIMEOUT_S = 60.0  # a hang guard only: every wait below ends on an event
BOUND = 2


def batch(step: int) -> Batch:
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [np.array([1000 + step, 5, 6, 7], np.int32)],
        "loss_mask": [np.array([0, 1, 1, 1], np.uint8)],
        "logprobs": [np.array([0.0, -0.5, -0.25, -1.0], np.float32)],
    }
    return Batch.from_columns("run", step, chunks, [4], {"advantage": [0.5], "env": ["e"], "reward": [1.0]})


class TrainerEnd(Protocol):
    held: int  # the last step it acknowledged: where it resumes after a restart

    async def recv(self) -> int: ...  # the next step it accepts
    async def ack(self, step: int) -> None: ...
    def close(self) -> None: ...


class ZmqEnd:
    def __init__(self, address: str, held: int) -> None:
        self.held = held
        self.receiver = BatchReceiver(address, last_step=None if held < 0 else held, auto_ack=False)

    async def recv(self) -> int:
        b = await self.receiver.recv()
        assert int(b.columns["token_ids"][0]) == 1000 + b.step
        return b.step

    async def ack(self, step: int) -> None:
        await self.receiver.ack(step)
        self.held = step

    def close(self) -> None:
        self.receiver.close()


class FileEnd:
    """Reading a step consumes its file: for this transport, that is the acknowledgement."""

    def __init__(self, directory: Path, held: int) -> None:
        self.held = held
        self.receiver = FileBatchReceiver(directory, next_step=held + 1, poll_s=0.01)

    async def recv(self) -> int:
        b = await self.receiver.arecv()
        self.held = b.step
        return b.step

    async def ack(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class PrimeRLEnd:
    """prime-rl's trainer: it counts messages from its start step (our step + 1) and acknowledges a step by
    broadcasting the weights it trained on it."""

    def __init__(self, trainer_dir: Path, address: str | None, held: int) -> None:
        self.held = held
        self.trainer = FakePrimeRLTrainer(trainer_dir, 2, address, start_step=held + 2)
        self.trainer.start()

    async def recv(self) -> int:
        grid = await self.trainer.step()
        firsts = {mbs[0].input_ids[0] for mbs in grid}  # one sample: every rank holds it (or a dummy of it)
        assert len(firsts) == 1, firsts
        step = firsts.pop() - 1000
        assert self.trainer.step_now == step + 1  # its own count lines up with ours
        return step

    async def ack(self, step: int) -> None:
        self.trainer.publish(step + 1)
        self.held = step

    def close(self) -> None:
        self.trainer.close()


class ManifestSender(BatchSender):
    """The zmq link in direct mode, as the orchestrator drives it: a step's sample is written into the worker's
    pool (what the env worker does) and the step goes out as its manifest."""

    store: ColumnStore
    pool_info: PoolInfo

    async def _deliver(self, batch: Any) -> tuple[list[Any], int]:
        assert isinstance(batch, Batch)
        rid = f"r{batch.step}"
        sample = Sample(token_ids=batch.columns["token_ids"], loss_mask=batch.columns["loss_mask"],
                        logprobs=batch.columns["logprobs"], routed_experts=None)
        shapes, dtype, _ = rollout_layout([sample])
        span = self.store.put(rid, [sample])
        assert span is not None
        header = RolloutHeader(rid=rid, group="g", env="e", task=0, policy_step=0, worker="w", server="s", ok=True,
                               reward=1.0, samples=shapes, routed_dtype=dtype, tokens=shapes[0][0], span=span)
        manifest = build_manifest(batch.run, batch.step, [(RolloutRecord(header, []), 0.5)], {"w": self.pool_info})
        return await super()._deliver(manifest)


@contextlib.asynccontextmanager
async def _direct(tmp: Path, resume: bool) -> AsyncIterator[Sender[Any]]:
    """A worker's pool served next to a ManifestSender; a new pool for every sender (a restarted orchestrator's
    workers renew theirs)."""
    store = ColumnStore(1 << 20)
    path = str(tmp / f"{store.id[-8:]}.pool")
    try:
        async with serve_pool(store, path), ManifestSender.open(f"ipc://{tmp}/t.sock", BOUND, 5.0,
                                                                require_report=resume) as sender:
            assert isinstance(sender, ManifestSender)  # open() is BatchSender's: typed as the base
            sender.store = store
            sender.pool_info = PoolInfo(id=store.id, size=store.capacity, host=socket.gethostname(), path=path)
            yield sender
    finally:
        store.close()


@dataclass(frozen=True)
class Kind:
    name: str
    open: Callable[[Path, bool], contextlib.AbstractAsyncContextManager[Sender[Any]]]
    trainer: Callable[[Sender[Any], Path, int], TrainerEnd]
    knows_trainer_steps: bool = True  # a restarted sender learns what the trainer has (and skips it)
    trainer_survives_sender_restart: bool = True  # prime-rl's sends READY once: it restarts with the sender


def _prime_rl(layout: Layout) -> Callable[[Path, bool], contextlib.AbstractAsyncContextManager[Sender[Any]]]:
    def open_(tmp: Path, resume: bool) -> contextlib.AbstractAsyncContextManager[Sender[Any]]:
        return PrimeRLSender.open(tmp / "trainer", data_ranks=2, seq_len=64, layout=layout,
                                  address="tcp://127.0.0.1:0" if layout == "zmq" else None, window=BOUND,
                                  resume=resume, warn_s=5.0, poll_s=0.01)
    return open_


KINDS = [
    Kind("zmq", lambda tmp, resume: BatchSender.open(f"ipc://{tmp}/t.sock", BOUND, 5.0, require_report=resume),
         lambda sender, _tmp, held: ZmqEnd(sender.address, held)),
    Kind("shm", lambda tmp, resume: BatchSender.open(f"ipc://{tmp}/t.sock", BOUND, 5.0, require_report=resume,
                                                     shm_bytes=1 << 20),
         lambda sender, _tmp, held: ZmqEnd(sender.address, held)),
    Kind("zmq-direct", _direct, lambda sender, _tmp, held: ZmqEnd(sender.address, held)),
    Kind("filesystem", lambda tmp, resume: FileBatchSender.open(tmp / "batches", BOUND, resume=resume),
         lambda _sender, tmp, held: FileEnd(tmp / "batches", held), knows_trainer_steps=False),
    Kind("prime-rl", _prime_rl("zmq"), lambda sender, tmp, held: PrimeRLEnd(tmp / "trainer", sender.address, held),
         trainer_survives_sender_restart=False),
    Kind("prime-rl-files", _prime_rl("filesystem"), lambda _sender, tmp, held: PrimeRLEnd(tmp / "trainer", None, held)),
]


@pytest.fixture(params=KINDS, ids=[k.name for k in KINDS])
def kind(request: pytest.FixtureRequest) -> Kind:
    k: Kind = request.param
    return k


async def send_all(sender: Sender[Any], steps: range) -> list[bool]:
    return [await sender.send(batch(step)) for step in steps]


async def take(end: TrainerEnd, n: int, *, ack: bool = True) -> list[int]:
    got = []
    for _ in range(n):
        got.append(await end.recv())
        if ack:
            await end.ack(got[-1])
    return got


@contextlib.asynccontextmanager
async def trainer_end(kind: Kind, sender: Sender[Any], tmp: Path, held: int) -> AsyncIterator[TrainerEnd]:
    end = kind.trainer(sender, tmp, held)
    try:
        yield end
    finally:
        end.close()


@contextlib.asynccontextmanager
async def trainer_gone(sender: Sender[Any]) -> AsyncIterator[None]:
    """On exit, wait until the sender has seen the trainer's connections close, as it has when a real trainer
    comes back (it takes seconds to start); a trainer back within microseconds could say hello before its old
    connection is gone, and ZMQ would spread the resent steps over both."""
    if isinstance(sender, BatchSender):
        monitor = sender.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            yield
            event = await asyncio.wait_for(recv_monitor_message(monitor), TIMEOUT_S)
            assert event["event"] == zmq.EVENT_DISCONNECTED
        finally:
            sender.router.disable_monitor()
            monitor.close()
    else:
        yield
        if isinstance(sender, PrimeRLSender) and sender.layout == "zmq":  # prime-rl: each rank unsubscribed
            await wait_until(lambda: sender.presence.lost == {0, 1}, TIMEOUT_S, "both ranks lost", poll_s=0.005)


async def test_every_step_once_in_order(kind: Kind, tmp_path: Path) -> None:
    async with kind.open(tmp_path, False) as sender, trainer_end(kind, sender, tmp_path, -1) as end, \
            asyncio.timeout(TIMEOUT_S):
        sending = asyncio.ensure_future(send_all(sender, range(6)))
        assert await take(end, 6) == list(range(6))
        assert await sending == [True] * 6
        await sender.wait_acked()
        assert (sender.acked, dict(sender.unacked), sender.skipped) == (5, {}, [])


async def test_the_bound_holds_a_send_until_the_trainer_acknowledges(kind: Kind, tmp_path: Path) -> None:
    async with kind.open(tmp_path, False) as sender, trainer_end(kind, sender, tmp_path, -1) as end, \
            asyncio.timeout(TIMEOUT_S):
        assert await send_all(sender, range(BOUND)) == [True] * BOUND  # the trainer has taken none of them
        held = asyncio.ensure_future(sender.send(batch(BOUND)))
        await wait_until(lambda: sender.waiting, TIMEOUT_S, "the send waiting at the bound", poll_s=0.005)
        assert sender.next_step == BOUND  # waiting at the bound, not sent, not dropped
        assert await take(end, 1) == [0]
        assert await held is True
        assert await take(end, BOUND) == list(range(1, BOUND + 1))


async def test_a_restarted_trainer_gets_every_step_after_its_checkpoint(kind: Kind, tmp_path: Path) -> None:
    async with kind.open(tmp_path, False) as sender, asyncio.timeout(TIMEOUT_S):
        async with trainer_gone(sender), trainer_end(kind, sender, tmp_path, -1) as first:
            sending = asyncio.ensure_future(send_all(sender, range(4)))
            before = await take(first, 2) + await take(first, 1, ack=False)  # takes step 2, dies before acking it
            await sending
            checkpoint = first.held
        async with trainer_end(kind, sender, tmp_path, checkpoint) as second:
            sending = asyncio.ensure_future(send_all(sender, range(4, 6)))
            after = await take(second, 5 - checkpoint)
            assert await sending == [True, True]
    assert before == [0, 1, 2]
    assert before[:checkpoint + 1] + after == list(range(6))


async def test_a_restarted_sender_skips_what_the_trainer_has(kind: Kind, tmp_path: Path) -> None:
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(TIMEOUT_S):
        async with kind.open(tmp_path, False) as sender:
            end = kind.trainer(sender, tmp_path, -1)
            stack.callback(lambda: end.close())
            sending = asyncio.ensure_future(send_all(sender, range(3)))
            assert await take(end, 3) == [0, 1, 2]
            await sending
            await sender.wait_acked()
        # the orchestrator died after step 2 but its state said step 0 was the last acknowledged: it resumes at 1
        async with kind.open(tmp_path, True) as resumed:
            if not kind.trainer_survives_sender_restart:  # prime-rl: restarted from its checkpoint, as the sender
                end.close()
                end = kind.trainer(resumed, tmp_path, 2)
            sending = asyncio.ensure_future(send_all(resumed, range(1, 6)))
            assert await take(end, 3) == [3, 4, 5]
            sent = await sending
    if kind.knows_trainer_steps:
        assert sent == [False, False, True, True, True]
        assert resumed.skipped == [1, 2]


async def test_a_wait_for_weights_is_named_by_every_kind(kind: Kind, tmp_path: Path) -> None:
    """The liveness rule's clause from the link: where checkpoints come from, and (zmq) that it asked."""
    async with kind.open(tmp_path, False) as sender:
        announced = sender.announcements(tmp_path / "markers") if kind.name == "filesystem" else None
        said = sender.checkpoint_wanted(5)
        async with trainer_end(kind, sender, tmp_path, -1), asyncio.timeout(TIMEOUT_S):
            if isinstance(sender, BatchSender):
                await wait_until(lambda: sender.holder is not None, TIMEOUT_S, "the trainer heard", poll_s=0.005)
            elif isinstance(sender, PrimeRLSender) and sender.layout == "zmq":
                await wait_until(lambda: sender.presence.complete, TIMEOUT_S, "every rank present", poll_s=0.005)
            later = sender.checkpoint_wanted(5)
        if announced is not None:
            assert isinstance(announced, AsyncGenerator)
            await announced.aclose()
    expected = {
        "zmq": ("no trainer is connected to", "has announced no checkpoint; asked it for its newest"),
        "shm": ("no trainer is connected to", "has announced no checkpoint; asked it for its newest"),
        "zmq-direct": ("no trainer is connected to", "has announced no checkpoint; asked it for its newest"),
        "filesystem": (f"marker files step_<N>.ready in {tmp_path / 'markers'}", "none of step >= 5"),
        "prime-rl": ("has not sent READY from ranks [0, 1]", "broadcasts/step_N/STABLE after training our step N - 1"),
        "prime-rl-files": ("(there is none yet)", "broadcasts/step_N/STABLE after training our step N - 1"),
    }[kind.name]
    assert expected[0] in said, said
    assert expected[1] in later, later
