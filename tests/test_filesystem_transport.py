from __future__ import annotations

import asyncio
import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.delivery.filesystem import MAGIC, batch_path, read_batch_file, write_batch_file
from orchestrator.errors import DuplicateStep
from orchestrator.testing.procs import wait_until
from orchestrator.transport import Batch, CorruptBatchFile, FileBatchReceiver, FileBatchSender, encode


def make_batch(step: int = 0, lengths: tuple[int, ...] = (3, 5, 2)) -> Batch:
    rng = np.random.default_rng(step)
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(0, 1000, n, dtype=np.int32) for n in lengths],
        "loss_mask": [rng.integers(0, 2, n, dtype=np.uint8) for n in lengths],
        "logprobs": [rng.normal(size=n).astype(np.float32) for n in lengths],
        "routed_experts": [rng.integers(0, 64, (n, 4, 2), dtype=np.uint8) for n in lengths],
    }
    scalars: dict[str, list[Any]] = {"advantage": [0.5, -0.5, 0.0], "reward": [1.0, 0.0, 0.5], "env": ["a", "b", "a"]}
    return Batch.from_columns("run", step, chunks, list(lengths), scalars)


def assert_same(a: Batch, b: Batch) -> None:
    assert (a.run, a.step, a.scalars) == (b.run, b.step, b.scalars)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert list(a.columns) == list(b.columns)
    for name in a.columns:
        assert a.columns[name].dtype == b.columns[name].dtype
        np.testing.assert_array_equal(a.columns[name], b.columns[name])


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def total_size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


async def test_round_trip_of_several_steps_in_order(tmp_path: Path) -> None:
    sender = FileBatchSender(tmp_path, max_pending=4, poll_s=0.005)
    sent = [make_batch(step) for step in range(3)]
    for batch in sent:
        await sender.send(batch)
    assert names(tmp_path) == [f"step_0000000{i}.batch" for i in range(3)]
    assert sender.bytes_sent == total_size(tmp_path)
    receiver = FileBatchReceiver(tmp_path, poll_s=0.005)
    got = [receiver.recv(timeout=5) for _ in range(2)]
    got.append(await asyncio.wait_for(receiver.arecv(), 5))
    for a, b in zip(sent, got, strict=True):
        assert_same(a, b)
    assert names(tmp_path) == []  # consumed files are deleted
    assert receiver.rejected == {}


async def test_keep_done_renames_consumed_files(tmp_path: Path) -> None:
    sender = FileBatchSender(tmp_path)
    await sender.send(make_batch(0))
    receiver = FileBatchReceiver(tmp_path, keep_done=True)
    assert receiver.recv(timeout=5).step == 0
    assert names(tmp_path) == ["step_00000000.batch.done"]
    await sender.send(make_batch(1))  # a .done file is not pending
    assert receiver.recv(timeout=5).step == 1


async def test_arrays_share_memory_with_the_mapped_file(tmp_path: Path) -> None:
    batch = make_batch(0)
    await FileBatchSender(tmp_path).send(batch)
    got = FileBatchReceiver(tmp_path).recv(timeout=5)
    assert not batch_path(tmp_path, 0).exists()  # deleted, but the mapping stays valid
    for name, col in got.columns.items():
        assert not col.flags.owndata, name
        base: object = col
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base, memoryview), name
        mapped = base.obj
        assert isinstance(mapped, mmap.mmap), name
        assert np.shares_memory(col, np.frombuffer(mapped, np.uint8)), name
        assert col.ctypes.data % 64 == 0, f"{name} is not 64-byte aligned"
        np.testing.assert_array_equal(col, batch.columns[name])


async def test_batch_without_samples_round_trips(tmp_path: Path) -> None:
    empty = Batch.from_columns("run", 0, {"token_ids": [], "loss_mask": [], "logprobs": []}, [],
                               {"advantage": [], "env": []})
    await FileBatchSender(tmp_path).send(empty)
    got = FileBatchReceiver(tmp_path).recv(timeout=5)
    assert (got.step, got.num_samples, got.num_tokens) == (0, 0, 0)
    assert got.columns["logprobs"].dtype == np.float32


def test_file_layout_matches_the_documented_container(tmp_path: Path) -> None:
    frames = encode(make_batch(0))
    path = tmp_path / "x.batch"
    size = write_batch_file(path, frames)
    raw = path.read_bytes()
    assert len(raw) == size
    assert raw[:8] == MAGIC
    count = int.from_bytes(raw[8:16], "little")
    lengths = [int.from_bytes(raw[16 + 8 * i: 24 + 8 * i], "little") for i in range(count)]
    assert lengths == [memoryview(f).nbytes for f in frames]
    pos = 16 + 8 * count
    for frame, n in zip(frames, lengths, strict=True):
        pos = -(-pos // 64) * 64
        assert raw[pos:pos + n] == bytes(frame)
        pos += n
    assert pos == len(raw)


def test_a_failed_write_leaves_no_file(tmp_path: Path) -> None:
    frames = [b"header", np.arange(10)[::2]]  # a non-contiguous frame: the write fails after the header
    with pytest.raises(ValueError, match="not C-contiguous"):
        write_batch_file(tmp_path / "step_00000000.batch", frames)
    assert list(tmp_path.iterdir()) == []


async def test_receiver_ignores_temp_files(tmp_path: Path) -> None:
    (tmp_path / ".step_00000000.batch.123.tmp").write_bytes(MAGIC + b"\x05")  # a write in progress
    receiver = FileBatchReceiver(tmp_path)
    assert receiver.try_recv() is None
    assert receiver.rejected == {}
    await FileBatchSender(tmp_path).send(make_batch(0))
    assert receiver.recv(timeout=5).step == 0


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 10)


def _bad_magic(path: Path) -> None:
    with open(path, "r+b") as f:
        f.write(b"NOTABAT!")


def _bad_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[64] = 0xC1  # the header frame's first byte: never valid msgpack
    path.write_bytes(bytes(raw))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize(("corrupt", "message"), [
    (_truncate, "frame table implies"),
    (_bad_magic, "bad magic"),
    (_bad_header, "header is not msgpack"),
    (_empty, "shorter than the file header"),
])
async def test_corrupt_file_is_rejected_and_the_receiver_continues(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt: Callable[[Path], None], message: str) -> None:
    sender = FileBatchSender(tmp_path, max_pending=4)
    for step in range(3):
        await sender.send(make_batch(step))
    corrupt(batch_path(tmp_path, 1))
    with pytest.raises(CorruptBatchFile, match=f"step_00000001.batch: .*{message}"):
        read_batch_file(batch_path(tmp_path, 1))
    receiver = FileBatchReceiver(tmp_path)
    with caplog.at_level(logging.ERROR):
        assert receiver.recv(timeout=5).step == 0
        assert receiver.recv(timeout=5).step == 2
    assert receiver.rejected == {"CorruptBatchFile": 1}
    assert names(tmp_path) == ["step_00000001.batch.rejected"]
    assert "step_00000001.batch" in caplog.text
    assert message in caplog.text


async def test_file_whose_header_names_another_step_is_rejected(tmp_path: Path) -> None:
    write_batch_file(batch_path(tmp_path, 0), encode(make_batch(5)))
    write_batch_file(batch_path(tmp_path, 1), encode(make_batch(1)))
    receiver = FileBatchReceiver(tmp_path)
    assert receiver.recv(timeout=5).step == 1
    assert receiver.rejected == {"CorruptBatchFile": 1}


async def test_duplicate_step_file_is_rejected(tmp_path: Path) -> None:
    await FileBatchSender(tmp_path).send(make_batch(0))
    receiver = FileBatchReceiver(tmp_path)
    assert receiver.recv(timeout=5).step == 0
    write_batch_file(batch_path(tmp_path, 0), encode(make_batch(0)))  # e.g. a restarted sender
    write_batch_file(batch_path(tmp_path, 1), encode(make_batch(1)))
    assert receiver.recv(timeout=5).step == 1
    assert receiver.rejected == {"DuplicateStep": 1}
    assert names(tmp_path) == ["step_00000000.batch.rejected"]


async def test_missing_step_is_waited_for_not_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_batch_file(batch_path(tmp_path, 2), encode(make_batch(2)))
    receiver = FileBatchReceiver(tmp_path, next_step=1)
    with caplog.at_level(logging.ERROR):
        assert receiver.try_recv() is None
    assert "step 1 is missing" in caplog.text
    assert receiver.rejected == {}
    write_batch_file(batch_path(tmp_path, 1), encode(make_batch(1)))
    assert [receiver.recv(timeout=5).step for _ in range(2)] == [1, 2]


async def test_sender_refuses_a_gap_a_repeat_or_an_existing_file(tmp_path: Path) -> None:
    sender = FileBatchSender(tmp_path, max_pending=4)
    await sender.send(make_batch(0))
    with pytest.raises(DuplicateStep, match="the next step is 1"):
        await sender.send(make_batch(0))
    with pytest.raises(DuplicateStep, match="the next step is 1"):
        await sender.send(make_batch(2))
    with pytest.raises(DuplicateStep, match="already exists"):
        await FileBatchSender(tmp_path, max_pending=4).send(make_batch(0))  # a second sender, same step
    assert names(tmp_path) == ["step_00000000.batch"]


async def test_send_waits_while_max_pending_files_exist(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sender = FileBatchSender(tmp_path, max_pending=2, poll_s=0.005, warn_s=0.02)
    receiver = FileBatchReceiver(tmp_path, poll_s=0.005)
    await sender.send(make_batch(0))
    await sender.send(make_batch(1))
    with caplog.at_level(logging.WARNING):
        pending = asyncio.ensure_future(sender.send(make_batch(2)))
        try:
            await wait_until(lambda: sender.waiting and "has not consumed" in caplog.text, 5.0, "the warning",
                             poll_s=0.005)
            assert not pending.done()
            assert not batch_path(tmp_path, 2).exists()
            assert (await asyncio.to_thread(receiver.recv, 5)).step == 0  # consuming one frees a slot
            await asyncio.wait_for(pending, 5)
        finally:
            pending.cancel()
    assert not sender.waiting
    assert batch_path(tmp_path, 2).exists()
    assert [receiver.recv(timeout=5).step for _ in range(2)] == [1, 2]


def test_recv_times_out_naming_the_step(tmp_path: Path) -> None:
    receiver = FileBatchReceiver(tmp_path, next_step=3, poll_s=0.005)
    with pytest.raises(TimeoutError, match="no batch for step 3"):
        receiver.recv(timeout=0.02)


async def test_arecv_can_be_cancelled(tmp_path: Path) -> None:
    receiver = FileBatchReceiver(tmp_path, poll_s=0.005)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(receiver.arecv(), 0.05)
    await FileBatchSender(tmp_path).send(make_batch(0))
    assert (await asyncio.wait_for(receiver.arecv(), 5)).step == 0
