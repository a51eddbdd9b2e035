"""The per-token columns, declared once, and where one rollout's columns lie inside its span of a worker's pool.

``TOKEN_COLUMNS`` is the one declaration every stage reads: each column's name, dtype, and whether it is optional
(a rollout, and so a step, may lack it). Routed experts (``ROUTED``) are the one column with a shape per token
(``[tokens, layers, top_k]``) and a dtype per rollout (``uint8``, or ``uint16`` above 256 experts); they come last
and are absent when ``layers * top_k == 0``. Every place that carries columns (record frames, span layouts, batches,
manifests, dumps, the trainer's readers) goes through ``column_names``, so a new per-token column is one line here
plus the code that produces it and the code that reads it.

A rollout's columns, in a ``records`` message or a span of a worker's pool, are in the order of ``column_names``: the
required token columns, the optional ones the rollout has (its header's ``optional``), then routed experts; each is
the concatenation of the rollout's samples. In a span each column starts at a multiple of ``ALIGN`` from the start
of the pool (spans start at multiples of ``ALIGN`` too). So the layout follows from ``(tokens, layers, top_k, routed
dtype, optional columns)``, which the record header and the step manifest already carry: no per-column offsets
travel, and a reader recomputes and checks them.

A step carries an optional column only when every rollout in it has it (the trainer gets a column for every sample or
none), as it carries routed experts only when every rollout has the same routed shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np


@dataclass(frozen=True)
class TokenColumn:
    """One value per token of every sample: ``name``, ``dtype`` (little-endian on the wire), and whether a rollout
    may lack it (``optional``)."""

    name: str
    dtype: np.dtype[Any]
    optional: bool = False
    doc: str = ""


TOKEN_COLUMNS: tuple[TokenColumn, ...] = (
    TokenColumn("token_ids", np.dtype("<i4"), doc="prompt and completion tokens of every turn"),
    TokenColumn("loss_mask", np.dtype("u1"), doc="1 where the policy sampled the token (trained on)"),
    TokenColumn("logprobs", np.dtype("<f4"), doc="sampling logprob where loss_mask, else 0"),
    TokenColumn("versions", np.dtype("<i4"), optional=True,
                doc="the policy step that sampled the token (columns/versions.py: -1 not sampled, <= -2 bounded)"),
)
ROUTED = "routed_experts"  # [tokens, layers, top_k] of ROUTED_DTYPES; last, absent when layers * top_k == 0

TOKEN_DTYPES: dict[str, np.dtype[Any]] = {c.name: c.dtype for c in TOKEN_COLUMNS}
REQUIRED: tuple[str, ...] = tuple(c.name for c in TOKEN_COLUMNS if not c.optional)
OPTIONAL: tuple[str, ...] = tuple(c.name for c in TOKEN_COLUMNS if c.optional)
COLUMNS: tuple[str, ...] = (*(c.name for c in TOKEN_COLUMNS), ROUTED)  # every column there is, in order

ALIGN = 64  # every span and every column in it starts at a multiple of this many bytes
ROUTED_DTYPES: dict[str, np.dtype[Any]] = {"uint8": np.dtype("u1"), "uint16": np.dtype("<u2")}
MAX_POOL_BYTES = 1 << 40  # 1 TiB: far above any pool; keeps every offset arithmetic in exact integers
MAX_ROUTED_DIM = 4096  # layers or top_k: far above any model

RoutedDtype = Literal["uint8", "uint16"]
Offset = Annotated[int, msgspec.Meta(ge=0, le=MAX_POOL_BYTES)]
PoolId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


def optional_columns(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` as optional token columns, in declaration order; ValueError naming one that is not optional."""
    have = set(names)
    unknown = sorted(have - set(OPTIONAL))
    if unknown:
        raise ValueError(f"unknown optional columns {unknown} (optional token columns: {', '.join(OPTIONAL)})")
    return tuple(name for name in OPTIONAL if name in have)


def column_names(optional: Iterable[str] = ()) -> tuple[str, ...]:
    """The columns of a rollout (or step) that has the optional token columns ``optional``, in frame and span
    order: the token columns, then routed experts. ValueError for a name that is not an optional column."""
    have = optional_columns(optional)
    return (*(c.name for c in TOKEN_COLUMNS if not c.optional or c.name in have), ROUTED)


def shared_optional(each: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """The optional token columns that every one of ``each`` (rollouts, spans, samples) has: what a step of them
    carries (none when ``each`` is empty)."""
    have: set[str] | None = None
    for names in each:
        have = set(names) if have is None else have & set(names)
    return tuple(name for name in OPTIONAL if have and name in have)


class SpanLoc(msgspec.Struct, frozen=True, array_like=True):
    """Where a rollout's columns are: ``nbytes`` bytes at ``offset`` of pool ``pool`` (the worker's own)."""

    pool: PoolId
    offset: Offset
    nbytes: Offset


@dataclass(frozen=True)
class SpanLayout:
    """Byte ranges of each column inside a span, relative to the span's start; ``nbytes``: the whole span."""

    columns: dict[str, tuple[int, int]]  # name -> (offset from the span's start, bytes), in column_names order
    nbytes: int
    routed_dtype: np.dtype[Any]
    routed_tail: tuple[int, int]  # (layers, top_k); (0, 0): no routed experts

    def dtype(self, name: str) -> np.dtype[Any]:
        return self.routed_dtype if name == ROUTED else TOKEN_DTYPES[name]


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def span_layout(tokens: int, layers: int, top_k: int, routed_dtype: RoutedDtype,
                optional: Iterable[str] = ()) -> SpanLayout:
    """The layout of a rollout of ``tokens`` tokens with the optional token columns ``optional``, whose routed
    experts are ``[tokens, layers, top_k]`` of ``routed_dtype`` (``layers * top_k == 0``: none). ValueError for
    negative or oversized numbers, or a name that is not an optional column."""
    if tokens < 0 or not 0 <= layers <= MAX_ROUTED_DIM or not 0 <= top_k <= MAX_ROUTED_DIM:
        raise ValueError(f"no layout for {tokens} tokens with routed experts [{layers}, {top_k}]")
    if routed_dtype not in ROUTED_DTYPES:
        raise ValueError(f"routed experts of dtype {routed_dtype!r}, expected uint8 or uint16")
    dtype = ROUTED_DTYPES[routed_dtype]
    columns: dict[str, tuple[int, int]] = {}
    at = 0
    for name in column_names(optional):
        size = tokens * layers * top_k * dtype.itemsize if name == ROUTED else tokens * TOKEN_DTYPES[name].itemsize
        columns[name] = (at, size)
        at += align(size)
    return SpanLayout(columns, max(at, ALIGN), dtype, (layers, top_k) if layers and top_k else (0, 0))


def shapes_layout(shapes: list[tuple[int, int, int]], routed_dtype: RoutedDtype,
                  optional: Iterable[str] = ()) -> SpanLayout:
    """The layout of a rollout whose samples have ``(tokens, layers, top_k)`` shapes (a record header's
    ``samples``); ValueError when the samples' routed shapes differ."""
    tails = {(s[1], s[2]) for s in shapes}
    if len(tails) > 1:
        raise ValueError(f"routed-expert shapes differ across the rollout's samples: {sorted(tails)}")
    layers, top_k = tails.pop() if tails else (0, 0)
    return span_layout(sum(s[0] for s in shapes), layers, top_k, routed_dtype, optional)
