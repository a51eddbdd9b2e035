"""The data plane's worker side: span layout, the span allocator, and an env worker's column pool."""

from __future__ import annotations

import asyncio
import itertools
import random

import numpy as np
import pytest

from orchestrator.columns.alloc import SpanAllocator
from orchestrator.columns.layout import ALIGN, SpanLoc, shapes_layout, span_layout
from orchestrator.columns.samples import PlainNode, Sample, SampleError, build_sample
from orchestrator.columns.store import ColumnStore, PoolTooSmall, rollout_layout
from orchestrator.columns.versions import TokenVersions
from orchestrator.contracts.protocol import sample_frames


def make_sample(rng: np.random.Generator, tokens: int, layers: int = 0, top_k: int = 0, experts: int = 64) -> Sample:
    routed = rng.integers(0, experts, (tokens, layers, top_k)) if layers and top_k else None
    mask = [bool(i % 3) for i in range(tokens)]
    return build_sample([PlainNode(token_ids=rng.integers(0, 150_000, tokens).tolist(), mask=mask,
                                   logprobs=[-float(i % 7) / 3 for i in range(tokens) if mask[i]],
                                   routed_experts=routed)], TokenVersions(3))


def tiles(alloc: SpanAllocator) -> bool:
    """Free and taken ranges cover the pool exactly, each aligned; free ones never touch."""
    at = 0
    for start, end in sorted([*alloc.free_ranges, *alloc.taken_ranges]):
        if start != at or end <= start or start % ALIGN or end % ALIGN:
            return False
        at = end
    free = alloc.free_ranges
    return at == alloc.capacity and all(a[1] < b[0] for a, b in itertools.pairwise(free))


# ------------------------------------------------------------------------------------------------ layout


def test_span_layout_aligns_every_column_and_sizes_routed_experts_by_dtype() -> None:
    layout = span_layout(10, 4, 2, "uint16")
    assert layout.columns == {"token_ids": (0, 40), "loss_mask": (64, 10), "logprobs": (128, 40),
                              "routed_experts": (192, 160)}
    assert layout.nbytes == 384
    assert layout.routed_tail == (4, 2)
    empty = span_layout(0, 0, 0, "uint8")
    assert empty.nbytes == ALIGN
    assert all(n == 0 for _, n in empty.columns.values())
    assert span_layout(3, 0, 8, "uint8").routed_tail == (0, 0)  # no layers: no routed experts


@pytest.mark.parametrize(("args", "why"), [((-1, 0, 0, "uint8"), "tokens"), ((1, 5000, 1, "uint8"), "layers"),
                                           ((1, 1, 1, "int8"), "dtype")])
def test_span_layout_refuses_impossible_shapes(args: tuple[int, int, int, str], why: str) -> None:
    with pytest.raises(ValueError, match=r"layout|dtype"):
        span_layout(*args)  # type: ignore[arg-type]  # the point: a dtype span_layout refuses ("int8")


def test_shapes_layout_refuses_samples_whose_routed_shapes_differ() -> None:
    with pytest.raises(ValueError, match="differ"):
        shapes_layout([(4, 2, 2), (3, 0, 0)], "uint8")


# --------------------------------------------------------------------------------------------- allocator


def test_allocator_takes_first_fit_and_merges_freed_neighbours() -> None:
    alloc = SpanAllocator(10 * ALIGN)
    a, b, c = (alloc.take(n) for n in (1, 2 * ALIGN, ALIGN + 1))
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert alloc.taken_bytes == 5 * ALIGN
    assert a is not None
    assert b is not None
    assert c is not None
    alloc.give(b)
    assert alloc.take(3 * ALIGN) == 5 * ALIGN  # the hole left by b is too small: first fit skips it
    assert alloc.take(2 * ALIGN) == ALIGN  # and this one fits it exactly
    alloc.give(ALIGN)
    alloc.give(a)
    alloc.give(c)  # merges with both neighbours: one free range before the taken one at 5 * ALIGN
    assert alloc.free_ranges == ((0, 5 * ALIGN), (8 * ALIGN, 10 * ALIGN))
    assert tiles(alloc)
    assert alloc.take(6 * ALIGN) is None  # 7 free, but in two ranges
    with pytest.raises(KeyError):
        alloc.give(ALIGN)  # nothing taken there
    with pytest.raises(ValueError, match="multiple"):
        SpanAllocator(100)


def test_allocator_random_takes_and_gives_keep_the_pool_tiled() -> None:
    rnd = random.Random(20)
    alloc = SpanAllocator(256 * ALIGN)
    live: list[int] = []
    for _ in range(3000):  # bounded
        if live and (rnd.random() < 0.45 or alloc.largest_free < ALIGN):
            alloc.give(live.pop(rnd.randrange(len(live))))
        else:
            start = alloc.take(rnd.randint(1, 16 * ALIGN))
            if start is not None:
                live.append(start)
        assert tiles(alloc)
    for start in live:
        alloc.give(start)
    assert alloc.free_ranges == ((0, 256 * ALIGN),)
    assert alloc.spans == 0


# ------------------------------------------------------------------------------------------------- store


def pool_bytes(store: ColumnStore, loc: SpanLoc) -> bytes:
    return bytes(store._bytes[loc.offset:loc.offset + loc.nbytes])


@pytest.mark.parametrize(("layers", "top_k", "experts"), [(0, 0, 64), (3, 2, 64), (3, 2, 300)])
def test_a_rollout_is_written_once_with_the_same_bytes_as_its_column_frames(layers: int, top_k: int,
                                                                            experts: int) -> None:
    rng = np.random.default_rng(1)
    samples = [make_sample(rng, n, layers, top_k, experts) for n in (5, 17, 1)]
    store = ColumnStore(1 << 20)
    try:
        loc = store.put("r0", samples)
        assert loc is not None
        assert loc.pool == store.id
        assert loc.offset % ALIGN == 0
        shapes, dtype, layout = rollout_layout(samples)
        assert loc.nbytes == layout.nbytes
        assert dtype == ("uint16" if experts > 256 else "uint8")
        frame_shapes, frames = sample_frames(samples)  # what the through path sends for the same rollout
        assert frame_shapes == shapes
        raw = pool_bytes(store, loc)
        assert list(layout.columns) == ["token_ids", "loss_mask", "logprobs", "versions", "routed_experts"]
        for name, frame in zip(layout.columns, frames, strict=True):
            offset, nbytes = layout.columns[name]
            assert raw[offset:offset + nbytes] == (frame if isinstance(frame, bytes) else frame.tobytes()), name
    finally:
        store.close()


async def test_the_pool_is_bounded_and_a_writer_waits_for_a_release() -> None:
    rng = np.random.default_rng(2)
    big = [make_sample(rng, 2400)]  # 31 kB of columns: two fit a 64 kB pool
    store = ColumnStore(64 * 1024, warn_s=60)
    try:
        held = ["r0", "r1"]
        for rid in held:
            assert store.put(rid, big) is not None
        assert store.put("late", big) is None  # full: nothing written, nothing taken
        assert store.live_bytes == 2 * rollout_layout(big)[2].nbytes
        writer = asyncio.create_task(store.write("late", big))
        await asyncio.sleep(0)  # a yield, not a wait: the writer runs until it waits for a release
        assert not writer.done()
        assert store.release(["unknown"]) == 0
        await asyncio.sleep(0)
        assert not writer.done()
        assert store.release(held[:1]) == 1
        loc = await asyncio.wait_for(writer, 10)  # a hang guard only
        assert store.span("late") == loc
        assert store.span(held[0]) is None
        assert store.release(held[:1]) == 0  # releases are idempotent
    finally:
        store.close()


def test_a_rollout_larger_than_the_pool_is_refused_at_once_and_counted() -> None:
    store = ColumnStore(4096)
    try:
        with pytest.raises(PoolTooSmall, match="worker_pool_mb"):
            store.put("huge", [make_sample(np.random.default_rng(3), 2000)])
        assert store.too_large == 1
        assert store.live_bytes == 0
    finally:
        store.close()


def test_samples_whose_routed_shapes_differ_are_an_inconsistent_rollout() -> None:
    rng = np.random.default_rng(4)
    store = ColumnStore(1 << 16)
    try:
        with pytest.raises(SampleError, match="differ"):
            store.put("r", [make_sample(rng, 4, 2, 2), make_sample(rng, 4)])
        with pytest.raises(ValueError, match="no samples"):
            store.put("r", [])
        assert store.put("r", [make_sample(rng, 4)]) is not None
        with pytest.raises(ValueError, match="already holds"):
            store.put("r", [make_sample(rng, 4)])
    finally:
        store.close()


def test_renew_gives_a_fresh_pool_with_a_new_id_and_no_spans() -> None:
    rng = np.random.default_rng(5)
    store = ColumnStore(1 << 16)
    try:
        first = store.id
        store.put("r", [make_sample(rng, 8)])
        store.renew()
        assert store.id != first
        assert store.span("r") is None
        assert store.live_bytes == 0
        assert store.metrics() == {"pool_mb": 0, "live_mb": 0.0, "spans": 0, "largest_free_mb": 0.06}
    finally:
        store.close()
