"""Bad messages on the trainer link, over real ZMQ sockets on ipc:// in tmp_path.

Orchestrator -> trainer: corrupt, truncated, foreign and replayed batches sent by a raw ROUTER socket to a real
``BatchReceiver`` and ``SyncBatchReceiver``: each is rejected with a logged reason and counted by type, never
acknowledged, and the receiver then accepts the next valid step. Trainer -> orchestrator: malformed
messages on the ack channel of a real ``BatchSender`` are logged and ignored, and the link keeps working.
Last, hypothesis fuzzes ``wire.decode`` with structured headers (tests/test_transport.py fuzzes raw bytes).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.contracts.link import ckpt_address
from orchestrator.errors import WireError
from orchestrator.testing.links import RawLink, raw_link
from orchestrator.transport import Batch, BatchReceiver, BatchSender, SyncBatchReceiver, decode, encode, encode_step

LINK_LOGGER = "orchestrator.delivery.zmq_link"
RECEIVER_LOGGER = "orchestrator.trainer.receiver"
Frames = list[bytes]


def batch(step: int, lengths: tuple[int, ...] = (3, 2)) -> Batch:
    rng = np.random.default_rng(step)
    n = len(lengths)
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(0, 1000, k, dtype=np.int32) for k in lengths],
        "loss_mask": [np.ones(k, np.uint8) for k in lengths],
        "logprobs": [rng.normal(size=k).astype(np.float32) for k in lengths],
        "routed_experts": [rng.integers(0, 64, (k, 2, 2), dtype=np.uint8) for k in lengths],
    }
    scalars: dict[str, list[Any]] = {"advantage": [0.5 - i for i in range(n)],
                                     "reward": [float(i % 2) for i in range(n)], "env": ["ab"[i % 2] for i in range(n)]}
    return Batch.from_columns("run", step, chunks, list(lengths), scalars)


def frames_of(step: int) -> Frames:
    return [bytes(f) for f in encode(batch(step))]


def with_header(of: int, /, **changes: Any) -> Frames:
    """Step ``of``'s frames with header fields replaced."""
    frames = frames_of(of)
    header = msgpack.unpackb(frames[0])
    header.update(changes)
    return [msgpack.packb(header), *frames[1:]]


def with_column(of: int, /, **changes: Any) -> Frames:
    """Step ``of``'s frames with the first column entry's fields replaced."""
    frames = frames_of(of)
    header = msgpack.unpackb(frames[0])
    header["columns"][0].update(changes)
    return [msgpack.packb(header), *frames[1:]]


@dataclass(frozen=True)
class Bad:
    """A bad message sent between valid steps 0 and 1: the rejection type counted and the logged reason."""

    id: str
    frames: Callable[[], Frames]
    rejected: str
    reason: str


BAD = [
    Bad("truncated-header", lambda: [frames_of(1)[0][:20], *frames_of(1)[1:]], "WireError", "header is not msgpack"),
    Bad("truncated-column", lambda: [*frames_of(1)[:3], frames_of(1)[3][:-4], *frames_of(1)[4:]], "WireError",
        "column logprobs: frame has 16 bytes, header implies 20"),
    Bad("missing-column-frame", lambda: frames_of(1)[:-1], "WireError", "3 column frames, header lists 4"),
    Bad("corrupt-offsets", lambda: with_header(1, offsets=[0, 4, 3]), "WireError", "offsets do not describe 2 samples"),
    Bad("corrupt-scalars", lambda: with_header(1, scalars={"advantage": [0.5]}), "WireError",
        "scalar 'advantage' does not have 2 values"),
    Bad("random-bytes", lambda: [random.Random(7).randbytes(64) for _ in range(3)], "WireError",
        "header is not msgpack"),
    Bad("empty-frame", lambda: [b""], "WireError", "header is not msgpack"),
    Bad("another-programs-msgpack", lambda: [msgpack.packb({"jsonrpc": "2.0", "method": "ping", "id": 1})],
        "WireError", "format version None, this receiver reads 1"),
    Bad("header-is-an-array", lambda: [msgpack.packb([1, "run", 1])], "WireError", "header is a list, not a map"),
    Bad("prime-rl-message", lambda: [b"data_rank|0|", bytes(encode_step(batch(1), seq_len=64, ranks=1).messages[0])],
        "WireError", "header is not msgpack"),
    Bad("newer-format-version", lambda: with_header(1, v=2), "WireError", "format version 2, this receiver reads 1"),
    Bad("header-misses-a-field", lambda: with_header(1, n=None), "WireError", "header misses or mangles a field"),
    Bad("replayed-step", lambda: frames_of(0), "DuplicateStep", "step 0 is duplicate: the last step received was 0"),
    Bad("step-from-the-future", lambda: frames_of(5), "DuplicateStep",
        "step 5 is out of order: the last step received was 0"),
    # these used to escape decode() as IndexError / OverflowError / ValueError and end recv()
    Bad("negative-sample-count", lambda: with_header(1, n=-1, offsets=[], scalars={}), "WireError", "n and step"),
    Bad("infinite-step", lambda: with_header(1, step=math.inf), "WireError", "step"),
    Bad("negative-column-tail", lambda: with_column(1, tail=[-1, -1]), "WireError", "column token_ids"),
]


@pytest.fixture
def link(tmp_path: Path) -> Iterator[RawLink]:
    """A raw ROUTER bound where a receiver connects, and a PULL on its channel back (as the orchestrator binds)."""
    with raw_link(f"ipc://{tmp_path}/raw.sock") as raw:
        yield raw


def reported_steps(link: RawLink, until: int) -> list[int]:
    """Every ``have`` the receiver sent, up to the first that reports ``until`` (messages keep their order)."""
    out: list[int] = []
    while until not in out:
        have = link.report().have
        assert have is not None, "a receiver's report always says what it has"
        out.append(have)
    return out


def check_rejection(bad: Bad, receiver: BatchReceiver | SyncBatchReceiver, got: list[int], link: RawLink,
                    caplog: pytest.LogCaptureFixture) -> None:
    assert got == [0, 1]
    assert receiver.rejected == {bad.rejected: 1}
    errors = [r.getMessage() for r in caplog.records if r.name == RECEIVER_LOGGER and r.levelno == logging.ERROR]
    assert len(errors) == 1, errors
    assert errors[0].startswith("rejected a batch: "), errors[0]
    assert bad.reason in errors[0], errors[0]
    assert set(reported_steps(link, until=1)) <= {-1, 0, 1}  # a rejected message is never acknowledged
    assert receiver.acked == 1


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
async def test_async_receiver_rejects_and_keeps_going(bad: Bad, link: RawLink,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.asyncio.Context()
    receiver = BatchReceiver(link.address, ctx)
    try:
        for frames in (frames_of(0), bad.frames(), frames_of(1)):
            link.send(receiver.id, frames)
        got = [(await asyncio.wait_for(receiver.recv(), 5)).step for _ in range(2)]
        check_rejection(bad, receiver, got, link, caplog)
    finally:
        receiver.close()
        ctx.term()


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_sync_receiver_rejects_and_keeps_going(bad: Bad, link: RawLink,
                                               caplog: pytest.LogCaptureFixture) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    receiver = SyncBatchReceiver(link.address, ctx)
    try:
        for frames in (frames_of(0), bad.frames(), frames_of(1)):
            link.send(receiver.id, frames)
        got = [receiver.recv(timeout_s=5).step for _ in range(2)]
        check_rejection(bad, receiver, got, link, caplog)
    finally:
        receiver.close()
        ctx.term()


def test_a_run_of_bad_messages_is_counted_by_type(link: RawLink) -> None:
    """Many rejections in a row, of both kinds, between two good steps: all counted, nothing lost."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    receiver = SyncBatchReceiver(link.address, ctx)
    try:
        link.send(receiver.id, frames_of(0))
        handled = BAD
        for bad in handled:
            link.send(receiver.id, bad.frames())
        link.send(receiver.id, frames_of(1))
        assert [receiver.recv(timeout_s=5).step for _ in range(2)] == [0, 1]
        expected = {kind: sum(b.rejected == kind for b in handled) for kind in ("WireError", "DuplicateStep")}
        assert expected == {"WireError": 15, "DuplicateStep": 2}
        assert receiver.rejected == expected
    finally:
        receiver.close()
        ctx.term()


# ------------------------------------------------------------------------------ trainer -> orchestrator

BAD_ACKS = [
    ("random-bytes", b"\xc1\xff\x00 not msgpack"),
    ("truncated-msgpack", msgpack.packb({"have": 3})[:-1]),
    ("an-array", msgpack.packb([0, 1])),
    ("a-string", msgpack.packb("have 3")),
    ("another-programs-map", msgpack.packb({"jsonrpc": "2.0", "result": "ok"})),
    ("nil-fields", msgpack.packb({"have": None, "checkpoint": None})),
    ("have-not-a-number", msgpack.packb({"have": "three"})),
    ("have-an-array", msgpack.packb({"have": [3]})),
    ("checkpoint-a-map", msgpack.packb({"checkpoint": {"step": 3}})),
    ("have-nan", msgpack.packb({"have": math.nan})),
    # Was: int(inf) raises OverflowError, which _read_trainer does not catch: its task ends, so no later ack or
    # checkpoint is read (send() then waits for ever) and the error only surfaces when the sender closes
    ("have-infinite", msgpack.packb({"have": math.inf})),
    ("checkpoint-infinite", msgpack.packb({"checkpoint": -math.inf})),
]


@pytest.mark.parametrize("message", [m for _, m in BAD_ACKS], ids=[i for i, _ in BAD_ACKS])
async def test_sender_ignores_malformed_trainer_messages(message: bytes, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    ctx = zmq.asyncio.Context()
    trainer, channel = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)  # a trainer's two sockets, by hand
    trainer.setsockopt(zmq.ROUTING_ID, b"t1")
    for s in (trainer, channel):
        s.setsockopt(zmq.LINGER, 0)
    try:
        async with BatchSender.open(f"ipc://{tmp_path}/t.sock", hwm=1, warn_s=5.0) as sender:
            trainer.connect(sender.address)
            channel.connect(ckpt_address(sender.address))
            await channel.send(msgpack.packb({"have": -1, "hello": True, "id": "t1"}))
            assert await asyncio.wait_for(sender.send(batch(0)), 5) is True
            assert decode(await asyncio.wait_for(trainer.recv_multipart(), 5)).step == 0
            await channel.send(message)
            await channel.send(msgpack.packb({"have": 0, "checkpoint": 7, "id": "t1"}))  # a valid report right after
            try:  # a hang guard: a sender that stopped reading never gets the report
                await asyncio.wait_for(sender.wait_acked(), 60)
            except TimeoutError:
                pytest.fail("the sender stopped reading the trainer channel after a malformed message")
            announced = sender.announcements()
            assert isinstance(announced, AsyncGenerator)  # a generator: closed below
            assert (await asyncio.wait_for(anext(announced), 5)).step == 7
            await announced.aclose()
            assert sender.acked == 0
            warnings = [r.getMessage() for r in caplog.records if r.name == LINK_LOGGER]
            assert len(warnings) == 1, warnings
            assert warnings[0].startswith(f"ignored a malformed message from the trainer ({len(message)} bytes): ")
            # and the link keeps working: the next step goes out and is received
            assert await asyncio.wait_for(sender.send(batch(1)), 5) is True
            assert decode(await asyncio.wait_for(trainer.recv_multipart(), 5)).step == 1
    finally:
        trainer.close()
        channel.close()
        ctx.term()


# ------------------------------------------------------------------------------ the header decoder


@pytest.mark.parametrize(("frames", "what"), [
    (lambda: with_header(0, n=-1, offsets=[], scalars={}), "n = -1 with no offsets: IndexError"),
    (lambda: with_header(0, step=math.inf), "step = inf: OverflowError"),
    (lambda: with_header(0, n=math.inf), "n = inf: OverflowError"),
    (lambda: with_header(0, offsets=[0, 3, 2**64 - 1]), "an offset beyond int64: OverflowError"),
    (lambda: with_column(0, tail=[-1, -1]), "a negative tail: ValueError from reshape"),
    (lambda: [with_column(0, dtype="|O")[0], bytes(5 * 8), *frames_of(0)[2:]], "dtype object: ValueError"),
    (lambda: [with_header(0, n=0, offsets=[0], scalars={},
                          columns=[{"name": "x", "dtype": "S0", "tail": [], "frame": 1}])[0], b""],
     "a zero-size dtype: ValueError"),
], ids=["negative-n", "infinite-step", "infinite-n", "huge-offset", "negative-tail", "object-dtype",
        "zero-size-dtype"])
def test_decode_turns_every_bad_header_into_a_wire_error(frames: Callable[[], Frames], what: str) -> None:
    """Was: each of these headers escapes decode() as another exception (named in the id), which ends a
    receiver's recv() instead of being counted in ``rejected``."""
    with pytest.raises(WireError):
        decode(frames())


SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=6)
           | st.binary(max_size=6))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids,
                                                                                          max_size=4), max_leaves=10)
HEADER_KEYS = ["v", "run", "step", "n", "offsets", "scalars", "columns"]
COLUMN_KEYS = ["name", "dtype", "tail", "frame"]
# values a plausible but wrong sender writes, next to arbitrary ones
NEAR = {
    "v": st.sampled_from([0, 1, 2, 1.0, True, "1"]),
    "n": st.integers(-2, 4),
    "step": st.integers(-2, 4) | st.floats(),
    "offsets": st.lists(st.integers(-2, 6), max_size=4),
    "dtype": st.sampled_from(["<i4", "|u1", "<f4", "<f8", "|O", "|S0", "<U2", "|V0", "M8", "int32", "nope"]),
    "tail": st.lists(st.integers(-2, 3), max_size=3),
    "frame": st.integers(-1, 5),
}


def field_value(key: str) -> st.SearchStrategy[Any]:
    return NEAR[key] | VALUES if key in NEAR else VALUES


@settings(max_examples=300, deadline=None, derandomize=True, report_multiple_bugs=False,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), lengths=st.lists(st.integers(0, 4), max_size=3))
def test_fuzzed_structured_header_raises_only_wire_error(data: st.DataObject, lengths: list[int]) -> None:
    """Start from a valid message, replace header fields and column entries with near-miss or arbitrary
    values, drop or cut frames: decode either returns a consistent Batch or raises WireError."""
    frames = [bytes(f) for f in encode(batch(0, tuple(lengths)))]
    header = msgpack.unpackb(frames[0])
    for key in data.draw(st.sets(st.sampled_from(HEADER_KEYS), max_size=3), label="header keys"):
        header[key] = data.draw(field_value(key), label=key)
    if isinstance(header.get("columns"), list) and header["columns"] and isinstance(header["columns"][0], dict):
        for key in data.draw(st.sets(st.sampled_from(COLUMN_KEYS), max_size=2), label="column keys"):
            header["columns"][0][key] = data.draw(field_value(key), label=f"columns[0].{key}")
    body = frames[1:]
    cut = data.draw(st.integers(0, len(body)), label="frames kept")
    body = body[:cut] + [f[: data.draw(st.integers(0, len(f)), label="bytes kept")] for f in body[cut:cut + 1]]
    try:
        got = decode([msgpack.packb(header), *body])
    except WireError:
        return
    assert got.offsets.shape == (got.num_samples + 1,)
    for name, col in got.columns.items():
        assert col.shape[0] == got.num_tokens, name


@settings(max_examples=300, deadline=None, derandomize=True)
@given(edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.integers(0, 400))
def test_fuzzed_header_bytes_raise_only_wire_error(edits: list[tuple[int, int]], cut: int) -> None:
    """Byte-level damage to a real header (overwritten bytes, then a cut): only WireError, or a valid Batch."""
    frames = frames_of(0)
    header = bytearray(frames[0])
    for pos, value in edits:
        header[pos % len(header)] = value
    try:
        decode([bytes(header[: max(cut, 1)]), *frames[1:]])
    except WireError:
        pass
