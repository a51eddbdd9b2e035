"""Where one rollout's columns lie inside its span of a worker's column pool: one rule, shared by writer and readers.

A span holds all the samples of one rollout, column after column, in the order of ``COLUMNS``; each column is
the concatenation of the rollout's samples (as the ``records`` frames are today) and starts at a multiple of
``ALIGN`` from the start of the pool (spans start at multiples of ``ALIGN`` too). Token columns have fixed
dtypes; routed experts are ``uint8`` or ``uint16`` ``[tokens, layers, top_k]`` (absent: 0 bytes). So the layout
follows from four numbers, ``(tokens, layers, top_k, routed dtype)``, which the record header and the step
manifest already carry: no per-column offsets travel, and a reader recomputes and checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

ALIGN = 64  # every span and every column in it starts at a multiple of this many bytes
COLUMNS = ("token_ids", "loss_mask", "logprobs", "routed_experts")
TOKEN_DTYPES: dict[str, np.dtype[Any]] = {"token_ids": np.dtype("<i4"), "loss_mask": np.dtype("u1"),
                                          "logprobs": np.dtype("<f4")}
ROUTED_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2")}
MAX_POOL_BYTES = 1 << 40  # 1 TiB: far above any pool; keeps every offset arithmetic in exact integers
MAX_ROUTED_DIM = 4096  # layers or top_k: far above any model

RoutedDtype = Literal["uint8", "uint16"]
Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_POOL_BYTES)]
PoolId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class SpanLoc(msgspec.Struct, frozen=True, array_like=True):
    """Where a rollout's columns are: ``nbytes`` bytes at ``offset`` of pool ``pool`` (the worker's own)."""

    pool: PoolId
    offset: Offset
    nbytes: Offset


@dataclass(frozen=True)
class SpanLayout:
    """Byte ranges of each column inside a span, relative to the span's start; ``nbytes``: the whole span."""

    columns: dict[str, tuple[int, int]]  # name -> (offset from the span's start, bytes)
    nbytes: int
    routed_dtype: np.dtype[Any]
    routed_tail: tuple[int, int]  # (layers, top_k); (0, 0): no routed experts


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def span_layout(tokens: int, layers: int, top_k: int, routed_dtype: RoutedDtype) -> SpanLayout:
    """The layout of a rollout of ``tokens`` tokens whose routed experts are ``[tokens, layers, top_k]`` of
    ``routed_dtype`` (``layers * top_k == 0``: none). ValueError for negative or oversized numbers."""
    if tokens < 0 or not 0 <= layers <= MAX_ROUTED_DIM or not 0 <= top_k <= MAX_ROUTED_DIM:
        raise ValueError(f"no layout for {tokens} tokens with routed experts [{layers}, {top_k}]")
    if routed_dtype not in ROUTED_DTYPES:
        raise ValueError(f"routed experts of dtype {routed_dtype!r}, expected uint8 or uint16")
    dtype = ROUTED_DTYPES[routed_dtype]
    sizes = [tokens * d.itemsize for d in TOKEN_DTYPES.values()] + [tokens * layers * top_k * dtype.itemsize]
    columns: dict[str, tuple[int, int]] = {}
    at = 0
    for name, size in zip(COLUMNS, sizes, strict=True):
        columns[name] = (at, size)
        at += align(size)
    return SpanLayout(columns, max(at, ALIGN), dtype, (layers, top_k) if layers and top_k else (0, 0))


def shapes_layout(shapes: list[tuple[int, int, int]], routed_dtype: RoutedDtype) -> SpanLayout:
    """The layout of a rollout whose samples have ``(tokens, layers, top_k)`` shapes (a record header's
    ``samples``); ValueError when the samples' routed shapes differ."""
    tails = {(s[1], s[2]) for s in shapes}
    if len(tails) > 1:
        raise ValueError(f"routed-expert shapes differ across the rollout's samples: {sorted(tails)}")
    layers, top_k = tails.pop() if tails else (0, 0)
    return span_layout(sum(s[0] for s in shapes), layers, top_k, routed_dtype)
