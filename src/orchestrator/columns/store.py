"""``ColumnStore``: one env worker's column pool, where each rollout's columns are written once and stay until
the orchestrator releases them (data plane, docs/data-plane.md).

The pool is one sealed memfd of ``capacity`` bytes (``transport.worker_pool_mb``; memfd.py), mapped
read-write by the worker alone; trainers on the same node get a read-only fd of it from ``serve_pool`` and
map it. ``write(rid, samples)`` takes one span (``SpanAllocator``: first fit, any release order), copies
each sample's arrays straight into their place in it (the layout of layout.py: no concatenation first,
so the bytes are written once) and returns the ``SpanLoc`` the record header carries instead of column
frames. ``release(rids)`` gives spans back: the orchestrator says so when a rollout can no longer train
(failed, filtered, stale, dropped) or the trainer acknowledged the step that read it.

The bound: at most ``capacity`` bytes of columns at once. ``write`` waits (asynchronously, warning every
``warn_s``) while no free range fits the rollout, woken by each ``release``; a rollout larger than the
whole pool can never fit and raises ``PoolTooSmall`` at once (its rollout fails, counted, and the log names
the key to raise). The wait itself is bounded by the group's deadline: the orchestrator cancels a group
that outlives ``scheduler.group_timeout_s``, which cancels the wait.

``renew()`` replaces the pool with a fresh one (new id), for an orchestrator that restarted: spans it
never heard of are gone with it, and a trainer still reading the old pool keeps its mapping (the kernel
frees the memory when the last mapping goes), so nothing a reader holds is ever overwritten.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from orchestrator.columns.alloc import SpanAllocator
from orchestrator.columns.layout import (
    ALIGN,
    ROUTED,
    RoutedDtype,
    SpanLayout,
    SpanLoc,
    shapes_layout,
    shared_optional,
)
from orchestrator.columns.memfd import SealedMemfd
from orchestrator.columns.samples import Sample, SampleError

log = logging.getLogger(__name__)


class PoolTooSmall(Exception):
    """A rollout whose columns are larger than the whole pool: it can never be written."""


def sample_shapes(samples: Sequence[Sample]) -> tuple[list[tuple[int, int, int]], RoutedDtype]:
    """Per sample ``(tokens, layers, top_k)`` (``(tokens, 0, 0)`` without routed experts) and the rollout's
    routed dtype: uint16 when some sample's expert ids need it, else uint8."""
    shapes = [(s.num_tokens, *s.routed_experts.shape[1:]) if s.routed_experts is not None else (s.num_tokens, 0, 0)
              for s in samples]
    wide = any(s.routed_experts is not None and s.routed_experts.dtype == np.uint16 for s in samples)
    return shapes, "uint16" if wide else "uint8"


def sample_optional(samples: Sequence[Sample]) -> tuple[str, ...]:
    """The optional token columns every one of a rollout's samples has: the rollout's (one sample without a column
    leaves the rollout without it)."""
    return shared_optional(s.optional for s in samples)


def rollout_layout(samples: Sequence[Sample]) -> tuple[list[tuple[int, int, int]], RoutedDtype, SpanLayout]:
    """Shapes, routed dtype and span layout of a rollout's samples (with the optional columns they all have:
    ``layout.columns``); SampleError when their routed shapes differ (one sample with routed experts and one
    without, or different layers / top_k)."""
    shapes, dtype = sample_shapes(samples)
    try:
        return shapes, dtype, shapes_layout(shapes, dtype, sample_optional(samples))
    except ValueError as e:
        raise SampleError(str(e)) from None


class ColumnStore:
    """See the module docstring. ``id``, ``capacity`` and ``fd`` are what ``serve_pool`` hands out."""

    def __init__(self, capacity_bytes: int, warn_s: float = 30.0) -> None:
        if capacity_bytes < ALIGN or capacity_bytes % ALIGN:
            raise ValueError(f"a column pool of {capacity_bytes} bytes: expected a positive multiple of {ALIGN}")
        self.capacity = capacity_bytes
        self.warn_s = warn_s
        self.too_large = 0  # rollouts refused: larger than the whole pool
        self._released = asyncio.Event()  # set by every release; writers waiting for room re-check
        self._open_pool()

    def _open_pool(self) -> None:
        self.id = f"{os.getpid()}-{secrets.token_hex(8)}"  # a new pool gets a new id, so readers re-fetch
        self._memfd = SealedMemfd("orchestrator-columns", self.capacity)
        self._bytes = np.frombuffer(self._memfd.map, np.uint8)
        self._alloc = SpanAllocator(self.capacity)
        self._spans: dict[str, SpanLoc] = {}  # rollout id -> its span

    @property
    def fd(self) -> int:
        return self._memfd.fd

    @property
    def live_bytes(self) -> int:
        return self._alloc.taken_bytes

    @property
    def largest_free(self) -> int:
        """The largest rollout (bytes) that fits now: what the worker's heartbeat reports as its room."""
        return self._alloc.largest_free

    def span(self, rid: str) -> SpanLoc | None:
        return self._spans.get(rid)

    def metrics(self) -> dict[str, Any]:
        """For the worker's heartbeat: pool size, bytes held, spans held, and the largest free range."""
        return {"pool_mb": self.capacity >> 20, "live_mb": round(self.live_bytes / 2**20, 2),
                "spans": len(self._spans), "largest_free_mb": round(self._alloc.largest_free / 2**20, 2)}

    def put(self, rid: str, samples: Sequence[Sample]) -> SpanLoc | None:
        """Write ``samples`` (a rollout's, at least one) into a new span; None (nothing written) while no
        free range fits. PoolTooSmall if the rollout can never fit, SampleError for inconsistent samples,
        ValueError for a rollout that already holds a span."""
        if rid in self._spans:
            raise ValueError(f"rollout {rid} already holds a span of pool {self.id}")
        if not samples:
            raise ValueError(f"rollout {rid} has no samples: nothing to store")
        _, _, layout = rollout_layout(samples)
        if layout.nbytes > self.capacity:
            self.too_large += 1
            raise PoolTooSmall(f"rollout {rid}: its columns take {layout.nbytes >> 20} MB, more than the whole "
                               f"{self.capacity >> 20} MB column pool of this worker (transport.worker_pool_mb)")
        start = self._alloc.take(layout.nbytes)
        if start is None:
            return None
        self._write(start, layout, samples)
        loc = self._spans[rid] = SpanLoc(self.id, start, layout.nbytes)
        return loc

    async def write(self, rid: str, samples: Sequence[Sample]) -> SpanLoc:
        """``put``, waiting for releases while the pool has no room (warning every ``warn_s``). Consumes
        releases; produces the span; wakes on each ``release``; cancelled with its group."""
        loop = asyncio.get_running_loop()
        t0 = warned = loop.time()
        while (loc := self.put(rid, samples)) is None:
            self._released.clear()
            try:
                async with asyncio.timeout(max(warned + self.warn_s - loop.time(), 0.0)):
                    await self._released.wait()
            except TimeoutError:
                warned = loop.time()
                log.warning("rollout %s waits for room in the column pool: %d of %d MB held by %d rollouts "
                            "(%.0f s so far; released when their steps are acknowledged)", rid,
                            self.live_bytes >> 20, self.capacity >> 20, len(self._spans), warned - t0)
        return loc

    def _write(self, start: int, layout: SpanLayout, samples: Sequence[Sample]) -> None:
        """The one copy: each sample's arrays into their rows of each column of the span at ``start``."""
        for name, (offset, nbytes) in layout.columns.items():
            if not nbytes:
                continue
            at = start + offset
            column = self._bytes[at:at + nbytes].view(layout.dtype(name))
            if name == ROUTED:
                column = column.reshape(-1, *layout.routed_tail)
            row = 0
            for part in _parts(samples, name):
                column[row:row + len(part)] = part
                row += len(part)

    def release(self, rids: Iterable[str]) -> int:
        """Give back the spans of ``rids``; the number of them that held one (a rollout released twice, or
        never stored, counts nothing: releases are idempotent)."""
        freed = 0
        for rid in rids:
            loc = self._spans.pop(rid, None)
            if loc is not None:
                self._alloc.give(loc.offset)
                freed += 1
        if freed:
            self._released.set()
        return freed

    def keep_only(self, keep: Iterable[str]) -> int:
        """Release every span but those of ``keep`` (the orchestrator's resync); the number released."""
        kept = set(keep)
        return self.release([rid for rid in self._spans if rid not in kept])

    def buffer(self) -> memoryview:
        """The whole pool, read-only (what a span server sends from; trainer/fetch.py)."""
        return memoryview(self._memfd.map).toreadonly()

    def renew(self) -> None:
        """A fresh pool with a new id (see the module docstring); writers waiting for room re-check."""
        old = self._memfd
        del self._bytes
        self._open_pool()
        old.close()
        self._released.set()

    def close(self) -> None:
        del self._bytes
        self._memfd.close()


def _parts(samples: Sequence[Sample], name: str) -> list[np.ndarray]:
    """Column ``name`` of each sample (every sample has it when the layout has bytes for it, as ``rollout_layout``
    made sure)."""
    return [part for s in samples if (part := s.column(name)) is not None]
