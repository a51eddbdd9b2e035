"""``PrimeRLSender`` against prime-rl's receivers, on real sockets and files: the READY barrier and what it does
not cover (subscriptions), a trainer that starts first, leftovers of another run, broadcasts as checkpoints."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from orchestrator.delivery.primerl import rank_file
from orchestrator.errors import TransportError
from orchestrator.testing.primerl import DECODER, FakePrimeRLTrainer, ZmqRank, check_step, free_port_pair, publish
from orchestrator.testing.procs import wait_until
from orchestrator.transport import Batch, Checkpoint, PrimeRLSender, latest_broadcast

TIMEOUT_S = 60.0  # hang guard only


def batch(step: int, n: int = 3) -> Batch:
    rng = np.random.default_rng(step)
    lengths = [5 + i for i in range(n)]
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(2, 1000, k, dtype=np.int32) for k in lengths],
        "loss_mask": [np.array([0] + [1] * (k - 1), np.uint8) for k in lengths],
        "logprobs": [rng.normal(size=k).astype(np.float32) for k in lengths],
    }
    scalars: dict[str, list[Any]] = {"advantage": [0.5] * n, "env": ["e"] * n}
    return Batch.from_columns("run", step, chunks, lengths, scalars)


def sender(tmp_path: Path, ranks: int, address: str | None = "tcp://127.0.0.1:0", **kwargs: Any) -> Any:
    return PrimeRLSender.open(tmp_path / "trainer", data_ranks=ranks, seq_len=16, address=address, warn_s=5.0,
                              poll_s=0.01, **kwargs)


async def test_nothing_is_sent_until_every_rank_is_ready(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.asyncio.Context()
    ranks: list[ZmqRank] = []
    try:
        async with sender(tmp_path, 3) as s, asyncio.timeout(TIMEOUT_S):
            ranks.append(ZmqRank(s.address, 0, ctx))
            with caplog.at_level(logging.INFO, "orchestrator.delivery.primerl"):
                sending = asyncio.ensure_future(s.send(batch(0)))
                await wait_until(lambda: "waits for the prime-rl trainer" in caplog.text, TIMEOUT_S, "the log line")
                await wait_until(lambda: s.presence.subscribed == s.presence.ready == {0}, TIMEOUT_S, "rank 0")
            assert "has not sent READY from ranks [" in caplog.text
            assert not sending.done()  # rank 0 alone: step 0 would be lost for ranks 1 and 2
            ranks += [ZmqRank(s.address, r, ctx) for r in (1, 2)]
            assert await sending is True
            grid = [await r.recv() for r in ranks]
            assert len(check_step(grid, seq_len=16)) == 3
    finally:
        for r in ranks:
            r.close()
        ctx.term()


async def test_ready_without_a_subscription_is_not_enough(tmp_path: Path) -> None:
    """prime-rl's barrier counts READY, which travels apart from the SUB's subscription; we wait for both."""
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    ranks: list[ZmqRank] = []
    try:
        async with sender(tmp_path, 2) as s, asyncio.timeout(TIMEOUT_S):
            host, _, port = s.address.rpartition(":")
            push.connect(f"{host}:{int(port) + 1}")
            for rank_id in (b"0", b"1", b"7", b"x"):  # 7 and x are ignored, with a warning
                await push.send(rank_id)
            sending = asyncio.ensure_future(s.send(batch(0)))
            await wait_until(lambda: s.presence.ready == {0, 1}, TIMEOUT_S, "READY from both ranks")
            assert not sending.done()  # READY, but nobody subscribed: PUB would drop the messages
            sub_only = [ctx.socket(zmq.SUB) for _ in range(2)]
            for r, sub in enumerate(sub_only):
                sub.setsockopt(zmq.LINGER, 0)
                sub.connect(s.address)
                sub.setsockopt(zmq.SUBSCRIBE, b"data_rank|%d|" % r)
            assert await sending is True
            for r, sub in enumerate(sub_only):
                topic, payload = await sub.recv_multipart()
                assert topic == b"data_rank|%d|" % r
                assert DECODER.decode(payload)
                sub.close()
    finally:
        for rank in ranks:
            rank.close()
        push.close()
        ctx.term()


async def test_a_trainer_started_first_loses_no_step(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    trainer = FakePrimeRLTrainer(tmp_path / "trainer", 2, address)
    trainer.start()  # connects and sends READY before anything is bound, as prime-rl's trainer may
    try:
        async with sender(tmp_path, 2, address) as s, asyncio.timeout(TIMEOUT_S):
            assert s.acked == -1  # the trainer's broadcasts/step_0: nothing of ours trained yet
            sending = asyncio.ensure_future(asyncio.gather(*(s.send(batch(k)) for k in range(3))))
            for k in range(3):
                grid = await trainer.step()
                assert trainer.step_now == k + 1
                assert len(check_step(grid, seq_len=16)) == 3
                trainer.publish()  # after its step k + 1: acknowledges our step k
            await sending
            await s.wait_acked()
            assert s.acked == 2
    finally:
        trainer.close()


async def test_files_layout_writes_rank_files_the_trainer_reads(tmp_path: Path) -> None:
    async with sender(tmp_path, 2, layout="filesystem", address=None) as s, asyncio.timeout(TIMEOUT_S):
        assert await s.send(batch(0)) is True
        files = sorted((tmp_path / "trainer" / "rollouts").rglob("*"))
        assert [p.relative_to(tmp_path / "trainer").as_posix() for p in files] == [
            "rollouts/step_1", "rollouts/step_1/rank_0.bin", "rollouts/step_1/rank_1.bin"]
        grid = [DECODER.decode(rank_file(tmp_path / "trainer", 0, r).read_bytes()) for r in range(2)]
        assert len(check_step(grid, seq_len=16)) == 3
        assert s.metrics()["transport"]["micro_batches_per_rank"] == 1


@pytest.mark.parametrize("layout", ["zmq", "filesystem"])
async def test_a_fresh_run_refuses_another_runs_steps(tmp_path: Path, layout: str) -> None:
    trainer_dir = tmp_path / "trainer"
    publish(trainer_dir, 0)
    if layout == "zmq":
        publish(trainer_dir, 4)
        match = r"broadcasts holds weights of steps \[4\] from an earlier run"
    else:
        rank_file(trainer_dir, 2, 0).parent.mkdir(parents=True)
        match = "rollouts holds steps from an earlier run"
    address = "tcp://127.0.0.1:0" if layout == "zmq" else None
    with pytest.raises(TransportError, match=match):
        async with sender(tmp_path, 1, address, layout=layout):
            pass
    async with sender(tmp_path, 1, address, layout=layout, resume=True) as s:
        assert s.acked == (3 if layout == "zmq" else -1)


async def test_the_newest_complete_broadcast_is_the_checkpoint(tmp_path: Path) -> None:
    trainer_dir = tmp_path / "trainer"
    for step in (0, 1, 2):
        publish(trainer_dir, step)
    (trainer_dir / "broadcasts" / "step_3").mkdir()  # being written: no STABLE yet
    assert latest_broadcast(trainer_dir) == Checkpoint(2, str((trainer_dir / "broadcasts" / "step_2").resolve()))
    async with sender(tmp_path, 1, resume=True) as s, asyncio.timeout(TIMEOUT_S):
        updates = s.announcements()
        assert (await anext(updates)).step == 2  # not 0 and 1 first: a weight sync loads the newest
        assert s.acked == 1
        publish(trainer_dir, 3)
        third = await anext(updates)
        assert third == Checkpoint(3, str((trainer_dir / "broadcasts" / "step_3").resolve()))
        assert s.acked == 2
