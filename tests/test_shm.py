"""The same-node shared-memory transport (``transport.kind = "shm"``), with real sockets and processes.

The other side runs in its own process (``tests/shm_peer.py``) where a test kills it or counts its fds and
mappings; in-process pairs cover the rest. Nothing may ever appear in /dev/shm.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import numpy as np
import pytest

from orchestrator.config import load_config
from orchestrator.contracts.wire import shm_layout
from orchestrator.delivery.shm import SpanRing
from orchestrator.errors import ConfigError, TransportError
from orchestrator.testing.procs import wait_until
from orchestrator.transport import Batch, BatchReceiver, BatchSender, SyncBatchReceiver

sys.path.insert(0, str(Path(__file__).parent))
from shm_peer import dev_shm, left_in_dev_shm, memfd_maps, open_fds, peer_batch

PEER = Path(__file__).parent / "shm_peer.py"
SPAN = shm_layout(peer_batch(0).columns)[1]  # bytes one peer batch takes in a pool

# Bounds are hang guards only: every wait ends on an event (a line, a batch, an acknowledgement). A peer process
# starts in about a second on a quiet machine and many times that with every core busy.
HANG_GUARD_S = 120.0
pytestmark = pytest.mark.timeout(300)


class Peer:
    """A shm_peer.py process; its JSON lines as they come. Killed by pid on exit if still running."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, timeout_s: float = HANG_GUARD_S) -> dict[str, int]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(timeout_s):
            raw = await self.proc.stdout.readline()
        assert raw, f"peer {self.proc.pid} ended (exit {await self.proc.wait()}) before printing"
        out: dict[str, int] = json.loads(raw)
        return out

    async def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()


@contextlib.asynccontextmanager
async def peer(*args: str) -> AsyncIterator[Peer]:
    # stdin a pipe of ours: a --hold peer waits on it, and ends if this process dies without killing it
    proc = await asyncio.create_subprocess_exec(sys.executable, str(PEER), *args, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE)
    try:
        yield Peer(proc)
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


def assert_equal(got: Batch, want: Batch) -> None:
    assert (got.step, got.run, got.num_samples, got.scalars) == (want.step, want.run, want.num_samples, want.scalars)
    np.testing.assert_array_equal(got.offsets, want.offsets)
    assert got.columns.keys() == want.columns.keys()
    for name, col in want.columns.items():
        assert got.columns[name].dtype == col.dtype
        np.testing.assert_array_equal(got.columns[name], col)


# ------------------------------------------------------------------------------------------ the allocator


def test_span_ring_frees_in_step_order_and_reuses_space() -> None:
    ring = SpanRing(1000)
    assert [ring.place(s, 300) for s in range(3)] == [0, 300, 600]
    assert ring.place(3, 300) is None  # 100 bytes left at the end, none at the start
    ring.release_through(0)
    assert ring.place(3, 300) == 0  # wraps into the space step 0 freed
    assert ring.place(4, 10) is None  # wrapped: the gap is [300, 300)
    ring.release_through(2)
    assert (ring.live_bytes, len(ring)) == (300, 1)
    assert ring.place(4, 700) == 300
    assert ring.place(5, 1) is None
    ring.release_through(4)
    assert (ring.live_bytes, len(ring), ring.place(6, 1000)) == (0, 0, 0)
    assert ring.place(7, 1001) is None


def test_a_span_dropped_out_of_order_is_freed_when_it_reaches_an_end() -> None:
    ring = SpanRing(1000)
    ring.place(0, 100)
    ring.place(1, 100)
    ring.drop(1)  # the newest: freed at once
    assert (len(ring), ring.place(1, 100)) == (1, 100)
    ring.place(2, 100)
    ring.drop(1)  # in the middle: freed once step 0 is
    assert len(ring) == 3
    ring.release_through(0)
    assert (len(ring), ring.live_bytes) == (1, 100)


# ------------------------------------------------------------------------------------------ in one process


async def test_round_trip_views_the_receivers_own_mapping_without_copies(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, shm_bytes=1 << 20) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            assert sender.pool is not None
            await sender.send(peer_batch(0))
            frames = sender.unacked[0]
            assert frames is not None
            assert [len(f) < 1024 for f in frames] == [True]  # the header alone goes over ZMQ
            header = msgpack.unpackb(frames[0])
            assert header["shm"] == {"id": sender.pool.id, "size": 1 << 20}
            assert all(c["shm_offset"] % 64 == 0 and "frame" not in c for c in header["columns"])
            got = await asyncio.wait_for(receiver.recv(), HANG_GUARD_S)
            assert_equal(got, peer_batch(0))
            assert got.shm_pool == sender.pool.id
            assert receiver.shm.mapping is not None
            mapping = np.frombuffer(receiver.shm.mapping, np.uint8)
            for name, col in got.columns.items():
                assert np.shares_memory(col, mapping), name  # a view of the receiver's mapping: no copy
                assert (col.flags.writeable, col.flags.owndata) == (False, False), name
                # and not of the sender's: the bytes went through the memfd, not through this process's heap
                assert not np.shares_memory(col, sender.pool._bytes), name
        finally:
            receiver.close()


async def test_auto_ack_releases_a_batch_at_the_next_recv_or_on_release(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, shm_bytes=1 << 20) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            assert sender.pool is not None
            await sender.send(peer_batch(0))
            first = await asyncio.wait_for(receiver.recv(), HANG_GUARD_S)
            await sender.send(peer_batch(1))
            await asyncio.sleep(0.1)  # a release sent at the first recv would be here by now (a check of absence:
            # no event says nothing was sent; a slow machine can only let a wrong release pass, never fail this)
            assert (sender.acked, sender.pool.spans) == (-1, 2)  # step 0 is still the trainer's
            assert_equal(first, peer_batch(0))
            second = await asyncio.wait_for(receiver.recv(), HANG_GUARD_S)  # step 0 is done now
            await wait_until(lambda: sender.acked == 0, HANG_GUARD_S, "step 0 acknowledged", poll_s=0.005)
            assert (sender.pool.spans, sorted(sender.unacked)) == (1, [1])
            await receiver.release(second)
            await wait_until(lambda: sender.acked == 1, HANG_GUARD_S, "step 1 acknowledged", poll_s=0.005)
            assert (sender.pool.live_bytes, sender.pool.spans) == (0, 0)
        finally:
            receiver.close()


async def test_sync_receiver_maps_the_pool_and_releases_on_the_next_recv(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, shm_bytes=1 << 20) as sender:
        receiver = SyncBatchReceiver(sender.address)
        try:
            assert sender.pool is not None
            for step in range(3):
                await sender.send(peer_batch(step))
                got = await asyncio.to_thread(receiver.recv, 5.0)
                assert_equal(got, peer_batch(step))
                assert receiver.shm.mapping is not None
                assert np.shares_memory(got.columns["routed_experts"], np.frombuffer(receiver.shm.mapping, np.uint8))
            await wait_until(lambda: sender.acked == 1, HANG_GUARD_S, "step 1 acknowledged", poll_s=0.005)
            assert receiver.shm.fetches == 1
        finally:
            receiver.close()


async def test_a_full_pool_back_pressures_until_the_trainer_releases(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    # room for three steps; the window (hwm = 8) is not what stops the fourth
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=8, warn_s=0.05, shm_bytes=3 * SPAN + 32) as sender:
        receiver = BatchReceiver(sender.address, auto_ack=False)
        try:
            assert sender.pool is not None
            for step in range(3):
                await asyncio.wait_for(sender.send(peer_batch(step)), HANG_GUARD_S)
            assert (sender.pool.live_bytes, sender.pool.spans) == (3 * SPAN, 3)
            with caplog.at_level(logging.WARNING, "orchestrator.delivery.shm"):
                fourth = asyncio.ensure_future(sender.send(peer_batch(3)))
                await wait_until(lambda: "of the shared-memory pool" in caplog.text, HANG_GUARD_S,
                                 "the warning after warn_s of waiting", poll_s=0.005)
                assert not fourth.done()
            assert "waits for" in caplog.text
            got = await asyncio.wait_for(receiver.recv(), HANG_GUARD_S)
            assert got.step == 0
            await receiver.release(got)
            await asyncio.wait_for(fourth, HANG_GUARD_S)
            third = sender.unacked[3]
            assert third is not None
            assert msgpack.unpackb(third[0])["columns"][0]["shm_offset"] == 0  # step 0's bytes reused
            for step in range(1, 4):  # steps 1..3 intact although step 3 reuses step 0's span
                assert_equal(await asyncio.wait_for(receiver.recv(), HANG_GUARD_S), peer_batch(step))
        finally:
            receiver.close()


async def test_a_batch_larger_than_the_pool_goes_as_frames_with_a_warning(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, shm_bytes=SPAN - 64) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            assert sender.pool is not None
            with caplog.at_level(logging.WARNING, "orchestrator.delivery.shm"):
                await sender.send(peer_batch(0))
            assert "exceed" in caplog.text
            assert "sent as ZMQ frames" in caplog.text
            got = await asyncio.wait_for(receiver.recv(), HANG_GUARD_S)
            assert_equal(got, peer_batch(0))
            assert (got.shm_pool, sender.pool.inline_steps, sender.pool.spans) == (None, 1, 0)
        finally:
            receiver.close()


async def test_shm_needs_an_ipc_address(tmp_path: Path) -> None:
    with pytest.raises(TransportError, match="ipc://"):
        async with BatchSender.open("tcp://127.0.0.1:0", shm_bytes=1 << 20):
            pass
    job = tmp_path / "job.toml"
    job.write_text('[inference]\nservers = ["http://127.0.0.1:8000/v1"]\n[scheduler]\nbatch_size = 4\n'
                   '[[env]]\ntaskset = "t"\ngroup_size = 4\n'
                   '[transport]\nkind = "shm"\naddress = "tcp://127.0.0.1:5555"\n')
    with pytest.raises(ConfigError, match=r"transport\.address: kind = 'shm' is same-node only"):
        load_config(job)
    job.write_text(job.read_text().replace('address = "tcp://127.0.0.1:5555"', "shm_pool_mb = 64"))
    assert load_config(job).transport.shm_pool_mb == 64


# ------------------------------------------------------------------------------------------ real processes


async def test_1000_steps_through_the_pool_leak_nothing(tmp_path: Path) -> None:
    steps = 1000
    before = dev_shm()
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, shm_bytes=16 * SPAN) as sender:
        assert sender.pool is not None
        async with peer("recv", sender.address, "--steps", str(steps)) as trainer:
            seen: dict[int, dict[str, int]] = {}
            mine: dict[int, tuple[int, int]] = {}
            for step in range(steps):
                await asyncio.wait_for(sender.send(peer_batch(step)), HANG_GUARD_S)
                assert sender.pool.spans <= 2  # at most hwm steps hold the pool
                seen[step] = await trainer.line()
                if step in (99, steps - 101):  # the trainer is connected at both (at the last step it may be gone)
                    gc.collect()  # earlier tests' garbage (sockets) must not move the count in between
                    mine[step] = (open_fds(), memfd_maps())
            assert [seen[s]["step"] for s in seen] == list(range(steps))
            assert await asyncio.wait_for(trainer.proc.wait(), HANG_GUARD_S) == 0
        await asyncio.wait_for(sender.wait_acked(), HANG_GUARD_S)
        assert (sender.pool.live_bytes, sender.pool.spans) == (0, 0)
    assert mine[99] == mine[steps - 101]  # our fds and our one mapping: stable
    assert mine[99][1] == 1
    assert (seen[99]["fds"], seen[99]["maps"]) == (seen[steps - 1]["fds"], seen[steps - 1]["maps"])
    assert (seen[steps - 1]["maps"], seen[steps - 1]["fetches"]) == (1, 1)  # one mapping, fetched once
    assert memfd_maps() == 0
    assert await left_in_dev_shm(before) == set()


async def test_a_sigkilled_trainer_restarts_refetches_the_pool_and_continues(tmp_path: Path) -> None:
    steps = 12
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, shm_bytes=4 * SPAN) as sender:
        assert sender.pool is not None
        sending = asyncio.ensure_future(asyncio.gather(*(sender.send(peer_batch(s)) for s in range(steps))))
        try:
            # the first trainer takes steps 0..4, releasing each but the last (--hold), and is killed holding
            # step 4 (step 5 may be on its way); it cannot have acknowledged more, however late we read its lines
            async with peer("recv", sender.address, "--steps", "5", "--hold") as first:
                got = [(await first.line())["step"] for _ in range(5)]
                await first.kill()
            # it had trained on step 4 before it died: it restarts from there
            async with peer("recv", sender.address, "--steps", str(steps - 5), "--last-step", "4") as second:
                lines = [await second.line() for _ in range(steps - 5)]
                assert await asyncio.wait_for(second.proc.wait(), HANG_GUARD_S) == 0
            await asyncio.wait_for(sending, HANG_GUARD_S)
        finally:
            sending.cancel()
        got += [line["step"] for line in lines]
        assert got == list(range(steps))  # every step once, in order, across the kill
        assert (lines[0]["fetches"], lines[0]["maps"]) == (1, 1)  # the new process mapped the pool itself
        await asyncio.wait_for(sender.wait_acked(), HANG_GUARD_S)
        assert (sender.pool.live_bytes, sender.pool.spans) == (0, 0)


async def test_a_sigkilled_sender_leaves_nothing_and_the_mapping_stays_valid(tmp_path: Path) -> None:
    before = dev_shm()
    address = f"ipc://{tmp_path}/t.sock"
    receiver = BatchReceiver(address, auto_ack=False)
    try:
        async with peer("send", address, "--steps", "100", "--pool", str(4 * SPAN)) as orchestrator:
            held = [await asyncio.wait_for(receiver.recv(), HANG_GUARD_S) for _ in range(2)]
            await orchestrator.kill()
        assert await left_in_dev_shm(before) == set()
        assert memfd_maps() == 1  # only our mapping keeps the memory now, and it still reads right
        for batch in held:
            assert_equal(batch, peer_batch(batch.step))
        # the orchestrator restarts (a new pool): the receiver maps that one, the old batches stay readable
        async with peer("send", address, "--steps", "2", "--start", "2", "--pool", str(4 * SPAN)) as restarted:
            later = [await asyncio.wait_for(receiver.recv(), HANG_GUARD_S) for _ in range(2)]
            await receiver.ack(3)
            assert await asyncio.wait_for(restarted.proc.wait(), HANG_GUARD_S) == 0
        assert ([b.step for b in later], receiver.shm.fetches) == ([2, 3], 2)
        assert held[0].shm_pool != later[0].shm_pool
        for batch in held + later:
            assert_equal(batch, peer_batch(batch.step))
        assert memfd_maps() == 2
    finally:
        receiver.close()
    del held, later, batch
    gc.collect()
    assert memfd_maps() == 0  # the last views went: unmapped, and with no process left the kernel frees it
    assert await left_in_dev_shm(before) == set()


async def test_a_clean_exit_leaves_nothing(tmp_path: Path) -> None:
    before = dev_shm()
    address = f"ipc://{tmp_path}/t.sock"
    receiver = BatchReceiver(address)
    try:
        async with peer("send", address, "--steps", "3", "--pool", str(4 * SPAN)) as orchestrator:
            got = [await asyncio.wait_for(receiver.recv(), HANG_GUARD_S) for _ in range(3)]
            await receiver.release(got[-1])
            assert await asyncio.wait_for(orchestrator.proc.wait(), HANG_GUARD_S) == 0
        assert [b.step for b in got] == [0, 1, 2]
        assert not (tmp_path / "t.sock.shm").exists()
    finally:
        receiver.close()
    del got
    gc.collect()
    assert memfd_maps() == 0
    assert await left_in_dev_shm(before) == set()
