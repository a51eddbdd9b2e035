"""The trainer link with CURVE, on real loopback sockets: ``BatchSender(server_keys=...)``, receivers with
``keys``, ``engines.open_sender`` from ``[security]``, and ``orchestrator receive --server-key/--client-key``.

A refused peer is refused before the authorized trainer starts (a failed-handshake event on each of the
sender's sockets), so "it changed nothing" is checked without waiting for anything to not happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from orchestrator.cli import main
from orchestrator.config import SecurityConfig
from orchestrator.engines import open_sender
from orchestrator.security import ClientKeys, ServerKeys
from orchestrator.testing.handshakes import failed_handshakes
from orchestrator.testing.keys import KeySet, make_key_set
from orchestrator.testing.procs import orchestrator_process, wait_until
from orchestrator.testing.steps import synthetic_config
from orchestrator.trainer.reference import read_journal
from orchestrator.transport import Batch, BatchReceiver, BatchSender, SyncBatchReceiver, TrainerRefused

TIMEOUT_S = 60.0  # a hang guard: every wait ends on an event (a message, a failed handshake)


def make_batch(step: int) -> Batch:
    chunks: dict[str, list[npt.NDArray[Any]]] = {
        "token_ids": [np.arange(4, dtype=np.int32)], "loss_mask": [np.array([0, 0, 1, 1], np.uint8)],
        "logprobs": [np.zeros(4, np.float32)]}
    return Batch.from_columns("run", step, chunks, [4], {"advantage": [0.5], "reward": [1.0], "env": ["a"]})


async def send_all(sender: BatchSender, steps: range) -> list[bool]:
    return [await sender.send(make_batch(step)) for step in steps]


@pytest.fixture
def keys(tmp_path: Path) -> KeySet:
    return make_key_set(tmp_path / "keys")


def tcp_sender(server_keys: ServerKeys | None, hwm: int = 4) -> contextlib.AbstractAsyncContextManager[BatchSender]:
    """A sender on a free pair of loopback ports (the trainer channel takes the port after the batches')."""
    return BatchSender.open("tcp://127.0.0.1:*", hwm, server_keys=server_keys)


def refused(keys: KeySet, which: str) -> ClientKeys | None:
    return {"no-keys": None, "unlisted-key": keys.client("intruder"),
            "wrong-server-key": keys.wrong_server("trainer")}[which]


FOR_GOOD = {"no-keys", "unlisted-key"}  # refusals libzmq does not retry: the client's connection is gone


async def forge(intruder: BatchReceiver, which: str) -> None:
    """Send what a forger would: queued, then dropped by the failed handshake; or, when the handshake failed
    first and for good, refused here (no connection is left to queue them in)."""
    try:
        await asyncio.wait_for(intruder.ack(5), TIMEOUT_S)  # "the trainer has steps up to 5": 0-5 would be skipped
        await asyncio.wait_for(intruder.announce(42), TIMEOUT_S)  # forged weights: step 42 would be loaded
    except TrainerRefused:
        assert which in FOR_GOOD


@pytest.mark.parametrize("which", ["no-keys", "unlisted-key", "wrong-server-key"])
async def test_only_the_authorized_trainer_gets_batches_and_is_heard(keys: KeySet, which: str) -> None:
    async with tcp_sender(keys.server()) as sender:
        with failed_handshakes(sender.router) as to_push, failed_handshakes(sender.pull) as to_pull:
            intruder = BatchReceiver(sender.address, keys=refused(keys, which), auto_ack=False)
            try:
                await forge(intruder, which)
                await to_push.next(TIMEOUT_S)
                await to_pull.next(TIMEOUT_S)
                trainer = BatchReceiver(sender.address, keys=keys.client("trainer"), auto_ack=False)
                try:
                    sending = asyncio.ensure_future(send_all(sender, range(3)))
                    got = [await asyncio.wait_for(trainer.recv(), TIMEOUT_S) for _ in range(3)]
                    assert [b.step for b in got] == [0, 1, 2]
                    assert await asyncio.wait_for(sending, TIMEOUT_S) == [True, True, True]
                    assert sender.skipped == []
                    await trainer.ack(2)
                    await trainer.announce(3)
                    await asyncio.wait_for(sender.wait_acked(), TIMEOUT_S)
                    assert sender.acked == 2
                    announced = sender.announcements()
                    assert isinstance(announced, AsyncGenerator)
                    assert (await asyncio.wait_for(anext(announced), TIMEOUT_S)).step == 3  # not 42
                    await announced.aclose()
                    assert not await intruder.batches.poll(0)
                    assert intruder.last_step is None
                finally:
                    trainer.close()
            finally:
                intruder.close()


@pytest.mark.parametrize(("which", "says"), [
    ("no-keys", "the server requires CURVE keys (its public key and this trainer's key pair); restart this trainer"),
    ("unlisted-key", "the server refused this trainer's key. Its public NAME.key must be in the server's "
                     "security.authorized_keys directory"),
    ("wrong-server-key", "the server's public key given to this trainer is not that server's"),
])
async def test_a_refused_trainer_says_why_once(keys: KeySet, which: str, says: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="orchestrator.security")

    def said() -> int:
        return sum(says in r.getMessage() for r in caplog.records)

    async with tcp_sender(keys.server()) as sender:
        receiver = BatchReceiver(sender.address, keys=refused(keys, which))
        receiving = asyncio.ensure_future(receiver.recv())
        try:
            await wait_until(lambda: said() > 0, TIMEOUT_S, f"a warning saying {says!r}")
            if which in FOR_GOOD:  # no connection is made again: recv says so instead of waiting for ever
                with pytest.raises(TrainerRefused, match=re.escape(says)):
                    await asyncio.wait_for(receiving, TIMEOUT_S)
                with pytest.raises(TrainerRefused, match=re.escape(says)):
                    await asyncio.wait_for(receiver.ack(0), TIMEOUT_S)
            else:
                assert not receiving.done()  # it goes on retrying
        finally:
            receiving.cancel()
            with contextlib.suppress(asyncio.CancelledError, TrainerRefused):
                await receiving
            receiver.close()
    assert said() == 1
    assert f"the handshake with {sender.address} failed" in caplog.text


async def test_sync_receiver_with_keys(keys: KeySet) -> None:
    async with tcp_sender(keys.server()) as sender:
        receiver = SyncBatchReceiver(sender.address, keys=keys.client("trainer"))
        try:
            sending = asyncio.ensure_future(send_all(sender, range(2)))
            got = [await asyncio.to_thread(receiver.recv, TIMEOUT_S) for _ in range(2)]
            assert [b.step for b in got] == [0, 1]
            assert await asyncio.wait_for(sending, TIMEOUT_S) == [True, True]
        finally:
            receiver.close()


def with_security(keys: KeySet) -> SecurityConfig:
    return SecurityConfig(server_key=str(keys.server_secret), authorized_keys=str(keys.authorized_dir))


async def test_open_sender_uses_the_configured_keys_on_tcp(keys: KeySet) -> None:
    cfg = dataclasses.replace(synthetic_config(8), security=with_security(keys))
    async with open_sender(cfg, "tcp://127.0.0.1:*", resume=False) as opened:
        assert isinstance(opened, BatchSender)
        sender = opened
        with failed_handshakes(sender.router) as failures:
            plain = BatchReceiver(sender.address)
            try:
                await failures.next(TIMEOUT_S)
            finally:
                plain.close()
        trainer = BatchReceiver(sender.address, keys=keys.client("trainer"))
        try:
            sending = asyncio.ensure_future(sender.send(make_batch(0)))
            assert (await asyncio.wait_for(trainer.recv(), TIMEOUT_S)).step == 0
            assert await asyncio.wait_for(sending, TIMEOUT_S) is True
        finally:
            trainer.close()


async def test_ipc_stays_plain_with_keys_configured(keys: KeySet, tmp_path: Path) -> None:
    cfg = dataclasses.replace(synthetic_config(8), security=with_security(keys))
    async with open_sender(cfg, f"ipc://{tmp_path}/trainer.sock", resume=False) as sender:
        receiver = BatchReceiver(sender.address)  # no keys: file permissions guard ipc://
        try:
            sending = asyncio.ensure_future(sender.send(make_batch(0)))
            assert (await asyncio.wait_for(receiver.recv(), TIMEOUT_S)).step == 0
            assert await asyncio.wait_for(sending, TIMEOUT_S) is True
        finally:
            receiver.close()


# ---------------------------------------------------------------------------------------------- the command


async def test_receive_command_with_keys(keys: KeySet, tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    async with tcp_sender(keys.server()) as sender:
        args = ["receive", sender.address, "--steps", "2", "--journal", str(journal),
                "--server-key", str(keys.server_public), "--client-key", str(keys.client_secret("trainer"))]
        async with orchestrator_process(*args) as proc:  # bounds: hang guards for a process start on a busy host
            assert await asyncio.wait_for(send_all(sender, range(2)), 180) == [True, True]
            assert await asyncio.wait_for(proc.wait(), 180) == 0
        await asyncio.wait_for(sender.wait_acked(), TIMEOUT_S)
    assert [line["step"] for line in read_journal(journal)] == [0, 1]


@pytest.mark.parametrize(("address", "flags", "expected"), [
    ("tcp://127.0.0.1:9", ["--server-key", "{server}"], "--server-key / --client-key: give both"),
    ("tcp://127.0.0.1:9", ["--server-key", "{server}", "--client-key", "{server}"],
     "--client-key: {server}: holds only a public key; expected the secret key file"),
    ("tcp://127.0.0.1:9", ["--server-key", "{client}", "--client-key", "{client}"],
     "--server-key: {client}: holds a secret key; expected a public key file"),
    ("ipc:///tmp/x.sock", ["--server-key", "{server}", "--client-key", "{client}"],
     "ipc:///tmp/x.sock is not tcp://; the orchestrator uses CURVE on tcp:// only"),
], ids=["one-flag", "public-as-client-key", "secret-as-server-key", "ipc-address"])
def test_receive_command_refuses_unusable_keys(address: str, flags: list[str], expected: str, keys: KeySet,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 before connecting, naming the flag and the file."""
    paths = {"server": str(keys.server_public), "client": str(keys.client_secret("trainer"))}
    assert main(["receive", address, *(f.format(**paths) for f in flags)]) == 2
    err = capsys.readouterr().err
    assert expected.format(**paths) in err, err
