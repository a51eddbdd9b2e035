from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import DuplicateStep, TrainerRefused, WireError
from orchestrator.testing.links import raw_link
from orchestrator.testing.procs import wait_until
from orchestrator.transport import (
    Batch,
    BatchReceiver,
    BatchSender,
    Checkpoint,
    SyncBatchReceiver,
    decode,
    encode,
    write_marker,
)


def make_batch(step: int = 0, lengths: tuple[int, ...] = (3, 5, 2), routed: bool = True) -> Batch:
    rng = np.random.default_rng(step)
    total = sum(lengths)
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(0, 1000, n, dtype=np.int32) for n in lengths],
        "loss_mask": [rng.integers(0, 2, n, dtype=np.uint8) for n in lengths],
        "logprobs": [rng.normal(size=n).astype(np.float32) for n in lengths],
    }
    if routed:
        chunks["routed_experts"] = [rng.integers(0, 64, (n, 4, 2), dtype=np.uint8) for n in lengths]
    scalars: dict[str, list[Any]] = {"advantage": [0.5, -0.5, 0.0][: len(lengths)] * 1,
                                     "reward": [1.0, 0.0, 0.5][: len(lengths)], "env": ["a", "b", "a"][: len(lengths)]}
    batch = Batch.from_columns("run", step, chunks, list(lengths), scalars)
    assert batch.num_tokens == total
    return batch


def test_round_trip_and_per_sample_views() -> None:
    batch = make_batch()
    back = decode(encode(batch))
    assert (back.run, back.step, back.num_samples) == ("run", 0, 3)
    for name, col in batch.columns.items():
        np.testing.assert_array_equal(back.columns[name], col)
        assert back.columns[name].dtype == col.dtype
    s1 = back.sample(1)
    assert s1["token_ids"].shape == (5,)
    assert s1["routed_experts"].shape == (5, 4, 2)
    assert (s1["advantage"], s1["env"]) == (-0.5, "b")


def test_receiver_arrays_share_memory_with_frames() -> None:
    frames = [bytes(f) for f in encode(make_batch())]  # what a socket hands over
    views = [memoryview(f) for f in frames]
    back = decode(views)
    for name, col in back.columns.items():
        assert not col.flags.owndata, name
        assert np.shares_memory(col, np.frombuffer(views[list(back.columns).index(name) + 1], np.uint8))


def test_encode_does_not_copy_columns() -> None:
    batch = make_batch()
    frames = encode(batch)
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), batch.columns["token_ids"])


def test_header_is_small() -> None:
    frames = encode(make_batch())
    assert len(frames[0]) < 1024


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda f: [], "empty message"),
        (lambda f: [b"\xc1", *f[1:]], "not msgpack"),
        (lambda f: f[:-1], "column frames, header lists"),
        (lambda f: [*f[:1], bytes(f[1])[:-4], *f[2:]], "frame has"),
        (lambda f: [msgpack.packb({**msgpack.unpackb(f[0]), "v": 2}), *f[1:]], "format version 2"),
        (lambda f: [msgpack.packb({**msgpack.unpackb(f[0]), "offsets": [0, 5]}), *f[1:]], "offsets"),
        (lambda f: [msgpack.packb([1, 2]), *f[1:]], "not a map"),
    ],
)
def test_corrupt_messages_are_wire_errors(mangle: Callable[[list[bytes]], list[bytes]], message: str) -> None:
    frames = [bytes(f) for f in encode(make_batch())]
    with pytest.raises(WireError, match=message):
        decode(mangle(frames))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.lists(st.binary(max_size=64), max_size=5))
def test_fuzzed_header_raises_only_wire_error(header: bytes, rest: list[bytes]) -> None:
    try:
        decode([header, *rest])
    except WireError:
        pass


async def send_all(sender: BatchSender, steps: range) -> list[bool]:
    return [await sender.send(make_batch(step)) for step in steps]


async def test_send_receive_in_order_with_checkpoint(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/t.sock"
    async with BatchSender.open(address, hwm=2) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            sending = asyncio.ensure_future(send_all(sender, range(3)))
            got = [await asyncio.wait_for(receiver.recv(), 5) for _ in range(3)]
            await asyncio.wait_for(sending, 5)
            assert [b.step for b in got] == [0, 1, 2]
            await receiver.announce(3)
            announced = sender.announcements()
            assert isinstance(announced, AsyncGenerator)  # a generator: closed below
            assert (await asyncio.wait_for(anext(announced), 5)).step == 3
            await announced.aclose()
        finally:
            receiver.close()


async def test_sender_refuses_a_gap_or_a_repeat(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=4) as sender:
        receiver = BatchReceiver(sender.address)
        try:
            await asyncio.wait_for(sender.send(make_batch(0)), 5)
            with pytest.raises(DuplicateStep, match="the next step is 1"):
                await sender.send(make_batch(0))
            with pytest.raises(DuplicateStep):
                await sender.send(make_batch(2))
        finally:
            receiver.close()


async def test_absent_trainer_back_pressures(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=1, warn_s=0.05) as sender:
        # nobody connected: ZMQ queues nothing for a PUSH without peers, so the first send already waits
        pending = asyncio.ensure_future(sender.send(make_batch(0)))
        with caplog.at_level(logging.WARNING, "orchestrator.transport"):
            await wait_until(lambda: "step 0 waits" in caplog.text, 60, "the send's warning", poll_s=0.01)
        assert not pending.done()
        receiver = BatchReceiver(sender.address)
        try:
            await asyncio.wait_for(pending, 5)
            assert (await asyncio.wait_for(receiver.recv(), 5)).step == 0
        finally:
            receiver.close()


async def test_receiver_rejects_duplicates_and_keeps_running(tmp_path: Path) -> None:
    with raw_link(f"ipc://{tmp_path}/raw.sock") as link:
        receiver = BatchReceiver(link.address)
        try:
            for frames in (encode(make_batch(0)), encode(make_batch(0)), [b"junk"], encode(make_batch(1))):
                link.send(receiver.id, frames)
            assert (await asyncio.wait_for(receiver.recv(), 5)).step == 0
            assert (await asyncio.wait_for(receiver.recv(), 5)).step == 1
            assert receiver.rejected == {"DuplicateStep": 1, "WireError": 1}
        finally:
            receiver.close()


async def test_marker_file_announcements(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock") as sender:
        write_marker(tmp_path / "ckpt", 1)
        write_marker(tmp_path / "ckpt", 2)
        announced = sender.announcements(tmp_path / "ckpt")
        assert isinstance(announced, AsyncGenerator)  # a generator: closed below
        assert [(await asyncio.wait_for(anext(announced), 5)).step for _ in range(2)] == [1, 2]
        await announced.aclose()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1.ready", "step_2.ready"]


def test_trainer_library_imports_without_verifiers() -> None:
    code = "import sys, orchestrator.transport; assert 'verifiers' not in sys.modules, 'verifiers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=180)


async def test_unacknowledged_window_back_pressures_until_the_trainer_acks(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2) as sender:
        receiver = BatchReceiver(sender.address, auto_ack=False)
        try:
            await asyncio.wait_for(send_all(sender, range(2)), 5)
            third = asyncio.ensure_future(sender.send(make_batch(2)))
            assert (await asyncio.wait_for(receiver.recv(), 5)).step == 0
            await wait_until(lambda: sender.waiting, 60, "the third send waiting at the bound", poll_s=0.005)
            assert not third.done()  # steps 0 and 1 unacknowledged: the window is full
            await receiver.ack(0)
            assert await asyncio.wait_for(third, 5) is True
            assert sorted(sender.unacked) == [1, 2]
            assert sender.acked == 0
        finally:
            receiver.close()


async def test_a_restarted_trainer_gets_the_steps_it_had_not_acknowledged(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=3) as sender:
        first = BatchReceiver(sender.address, auto_ack=False)
        await asyncio.wait_for(send_all(sender, range(3)), 5)
        assert (await asyncio.wait_for(first.recv(), 5)).step == 0
        await first.ack(0)
        assert (await asyncio.wait_for(first.recv(), 5)).step == 1  # received, then the trainer dies
        first.close()
        second = BatchReceiver(sender.address, last_step=0)  # resumes from its checkpoint of step 0
        try:
            got = [(await asyncio.wait_for(second.recv(), 5)).step for _ in range(2)]
            assert got == [1, 2]
            await asyncio.wait_for(send_all(sender, range(3, 4)), 5)
            assert (await asyncio.wait_for(second.recv(), 5)).step == 3
        finally:
            second.close()


async def test_after_a_restart_the_sender_skips_steps_the_trainer_has(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, require_report=True) as sender:
        receiver = BatchReceiver(sender.address, last_step=4)
        try:
            sent = await asyncio.wait_for(send_all(sender, range(3, 6)), 5)
            assert sent == [False, False, True]
            assert sender.skipped == [3, 4]
            assert (await asyncio.wait_for(receiver.recv(), 5)).step == 5
            assert receiver.rejected == {}
        finally:
            receiver.close()


async def test_sync_receiver(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2) as sender:
        receiver = SyncBatchReceiver(sender.address)
        try:
            sending = asyncio.ensure_future(send_all(sender, range(3)))
            got = [await asyncio.to_thread(receiver.recv, 5.0) for _ in range(3)]
            await asyncio.wait_for(sending, 5)
            assert [b.step for b in got] == [0, 1, 2]
            np.testing.assert_array_equal(got[2].columns["token_ids"], make_batch(2).columns["token_ids"])
            with pytest.raises(TimeoutError):
                receiver.recv(timeout_s=0.05)
            receiver.announce(3)
            announced = sender.announcements()
            assert isinstance(announced, AsyncGenerator)  # a generator: closed below
            assert (await asyncio.wait_for(anext(announced), 5)).step == 3
            await announced.aclose()
        finally:
            receiver.close()


# ------------------------------------------------------------------------------ liveness of the link

HANG_GUARD_S = 60.0  # every wait below ends on an event; this only bounds a hang


async def test_a_second_trainer_on_the_address_is_refused_and_the_first_gets_every_step(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2) as sender:
        first = BatchReceiver(sender.address, name="first")
        second = None
        try:
            await asyncio.wait_for(sender.send(make_batch(0)), HANG_GUARD_S)
            assert (await asyncio.wait_for(first.recv(), HANG_GUARD_S)).step == 0
            second = BatchReceiver(sender.address, name="second")
            with pytest.raises(TrainerRefused, match="trainer first already receives this link's batches"):
                await asyncio.wait_for(second.recv(), HANG_GUARD_S)
            with pytest.raises(TrainerRefused):  # and on every later call
                await second.recv()
            sending = asyncio.ensure_future(send_all(sender, range(1, 4)))
            got = [(await asyncio.wait_for(first.recv(), HANG_GUARD_S)).step for _ in range(3)]
            await asyncio.wait_for(sending, HANG_GUARD_S)
            assert got == [1, 2, 3]
            assert second.last_step is None  # it never got a step
        finally:
            first.close()
            if second is not None:
                second.close()
    assert any(r.getMessage().startswith("refused trainer second at ") for r in caplog.records)


async def test_a_trainer_behind_its_acknowledged_step_is_refused_naming_the_steps_it_lacks(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=4) as sender:
        first = BatchReceiver(sender.address)  # acknowledges on receipt, before anything is safe
        await asyncio.wait_for(send_all(sender, range(4)), HANG_GUARD_S)
        assert [(await asyncio.wait_for(first.recv(), HANG_GUARD_S)).step for _ in range(4)] == [0, 1, 2, 3]
        await wait_until(lambda: sender.acked == 3, HANG_GUARD_S, "step 3 acknowledged", poll_s=0.01)
        first.close()
        behind = BatchReceiver(sender.address, last_step=1)  # its checkpoint is older than its acknowledgements
        try:
            with pytest.raises(TrainerRefused, match=r"holds steps up to 1, but steps 2\.\.3 were acknowledged"):
                await asyncio.wait_for(behind.recv(), HANG_GUARD_S)
        finally:
            behind.close()
        assert sender.holder is None  # nobody is fed; sends wait and say so
        assert sender.acked == 3
        later = BatchReceiver(sender.address, last_step=3)  # restarted from a checkpoint that has them
        try:
            await asyncio.wait_for(send_all(sender, range(4, 5)), HANG_GUARD_S)
            assert (await asyncio.wait_for(later.recv(), HANG_GUARD_S)).step == 4
        finally:
            later.close()
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR" and "refused trainer" in r.getMessage()]
    assert len(errors) == 1
    assert "restart it from a checkpoint of step 3 or later" in errors[0]


async def test_with_kept_steps_a_trainer_behind_gets_the_steps_it_lacks(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=4, keep=4) as sender:
        first = BatchReceiver(sender.address)
        await asyncio.wait_for(send_all(sender, range(4)), HANG_GUARD_S)
        assert [(await asyncio.wait_for(first.recv(), HANG_GUARD_S)).step for _ in range(4)] == [0, 1, 2, 3]
        await wait_until(lambda: sender.acked == 3, HANG_GUARD_S, "step 3 acknowledged", poll_s=0.01)
        first.close()
        behind = BatchReceiver(sender.address, last_step=1)
        try:
            sending = asyncio.ensure_future(send_all(sender, range(4, 6)))
            got = [(await asyncio.wait_for(behind.recv(), HANG_GUARD_S)).step for _ in range(4)]
            await asyncio.wait_for(sending, HANG_GUARD_S)
            assert got == [2, 3, 4, 5]  # once each, in order, no gap
            assert behind.rejected == {}
        finally:
            behind.close()


async def test_a_resumed_trainer_tells_its_checkpoint_at_once(tmp_path: Path) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, require_report=True) as sender:
        receiver = BatchReceiver(sender.address, last_step=4, checkpoint=Checkpoint(5, "/ckpt/step_5"))
        try:
            announced = sender.announcements()
            assert isinstance(announced, AsyncGenerator)  # a generator: closed below
            assert await asyncio.wait_for(anext(announced), HANG_GUARD_S) == Checkpoint(5, "/ckpt/step_5")
            await announced.aclose()
        finally:
            receiver.close()


async def test_the_sender_asks_for_a_checkpoint_and_a_trainer_without_one_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2) as sender:
        assert "no trainer is connected" in sender.checkpoint_wanted(3)
        receiver = BatchReceiver(sender.address, name="t")
        receiving = asyncio.ensure_future(receiver.recv())
        try:
            await wait_until(lambda: sender.holder is not None, HANG_GUARD_S, "the trainer heard", poll_s=0.01)
            said = sender.checkpoint_wanted(3)
            assert said.startswith("trainer t at ")
            assert "has announced no checkpoint; asked it for its newest" in said
            await wait_until(lambda: receiver.checkpoint_wanted == 3, HANG_GUARD_S, "the request", poll_s=0.01)
            warnings = [r.getMessage() for r in caplog.records if "waits for weights of step >= 3" in r.getMessage()]
            assert len(warnings) == 1
            assert "this trainer has announced none" in warnings[0]
        finally:
            receiving.cancel()
            receiver.close()


async def test_a_wait_warns_on_time_while_the_trainer_keeps_reporting(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The trainer's status messages (every STATUS_S) wake the wait without changing anything: they must not
    restart the warning's count (it used to restart on each, so a warn_s above STATUS_S never fired)."""
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2, warn_s=1.5) as sender:
        receiver = BatchReceiver(sender.address, auto_ack=False)
        try:
            await asyncio.wait_for(send_all(sender, range(2)), HANG_GUARD_S)
            assert [(await asyncio.wait_for(receiver.recv(), HANG_GUARD_S)).step for _ in range(2)] == [0, 1]
            held = asyncio.ensure_future(sender.send(make_batch(2)))
            idle = asyncio.ensure_future(receiver.recv())  # idle: it reports every STATUS_S, acknowledges nothing
            said = "step 2 waits: the trainer at "
            await wait_until(lambda: any(said in r.getMessage() for r in caplog.records), HANG_GUARD_S,
                             "the warning", poll_s=0.05)
            assert not held.done()
            assert any("has not acknowledged steps [0, 1]" in r.getMessage() for r in caplog.records)
            idle.cancel()
            await receiver.ack(1)
            assert await asyncio.wait_for(held, HANG_GUARD_S) is True
        finally:
            receiver.close()


@pytest.mark.parametrize("acked", [True, False], ids=["every-step-acked", "a-step-unacked"])
async def test_a_trainer_gone_at_the_end_is_a_warning_only_if_it_left_steps_unacknowledged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, acked: bool) -> None:
    """A trainer given max_steps acknowledges its last step and leaves before the run ends (the demo's does):
    that is the usual end, not worth a warning; one that left with a step unacknowledged is."""
    caplog.set_level(logging.INFO, logger="orchestrator.delivery.zmq_link")
    async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=2) as sender:
        receiver = BatchReceiver(sender.address, auto_ack=False)
        try:
            await asyncio.wait_for(send_all(sender, range(2)), 5)
            for step in range(2):
                assert (await asyncio.wait_for(receiver.recv(), 5)).step == step
            await receiver.ack(1 if acked else 0)
            await wait_until(lambda: sender.acked == (1 if acked else 0), 5, "the acknowledgement", poll_s=0.01)
        finally:
            receiver.close()
        await wait_until(lambda: not sender.trainer_connected(), 5, "the trainer to disconnect", poll_s=0.01)
        assert sender.holder is not None
        name = sender.holder.name
        sender.run_finished()
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "has left" in r.getMessage()
            or "could not tell" in r.getMessage()]
    if acked:
        assert said == [(logging.INFO, f"trainer {name} acknowledged every step and has left")]
    else:
        assert [level for level, _ in said] == [logging.WARNING]
