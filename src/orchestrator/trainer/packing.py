"""Trainer side: pack one step's ``Batch`` into fixed-length micro-batches for data-parallel ranks.

``pack(batch, seq_len, dp)`` decides where every sample goes; it copies no token data. The result has
one ``RankBatches`` per rank, each with the same number of ``MicroBatch``es (ranks are padded with empty
micro-batches) so that all ranks step together. A micro-batch is a list of sample indices and each
sample's ``[start, end)`` inside the packed sequence of at most ``seq_len`` tokens; ``MicroBatch.arrays()``
materialises the packed columns with one fancy index per column (no per-token Python loop), plus
position ids that restart at 0 for every sample.

How samples are placed (deterministic for a given ``seed``; only ``np.random.default_rng(seed)`` is used):

1. Samples longer than ``seq_len`` are truncated to their first ``seq_len`` tokens
   (``overlong="truncate"``) or dropped (``overlong="reject"``); both are counted.
2. Samples are ordered by length, longest first; equal lengths are ordered by a seeded permutation.
3. In that order each sample goes to the rank with the fewest tokens so far (ties: lowest rank). This
   keeps every two ranks' token totals within one (possibly truncated) sample length of each other.
4. On each rank, samples are packed first-fit-decreasing into micro-batches of ``seq_len`` tokens.

Importable without verifiers.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

from orchestrator.contracts.wire import Batch

Overlong = Literal["truncate", "reject"]


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """Samples packed into one sequence of at most ``seq_len`` tokens.

    Sample ``samples[j]`` of ``batch`` occupies ``starts[j]:ends[j]`` of the packed sequence; it
    contributes its first ``ends[j] - starts[j]`` tokens (fewer than its length only if truncated).
    """

    batch: Batch = field(repr=False)
    samples: np.ndarray  # int64 [k], indices into batch
    starts: np.ndarray  # int64 [k], start of each sample in the packed sequence
    ends: np.ndarray  # int64 [k], end (exclusive)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens each sample contributes (int64 [k])."""
        out: np.ndarray = self.ends - self.starts
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.ends[-1]) if self.ends.size else 0

    @property
    def cu_seqlens(self) -> np.ndarray:
        """int32 [k + 1]: sample boundaries, as variable-length attention kernels expect them."""
        out = np.zeros(self.samples.size + 1, dtype=np.int32)
        out[1:] = self.ends
        return out

    @cached_property
    def index(self) -> np.ndarray:
        """int64 [num_tokens]: for every packed token, its row in the batch's columns."""
        lengths = self.lengths
        source = self.batch.offsets[self.samples]
        out: np.ndarray = np.arange(self.num_tokens, dtype=np.int64) + np.repeat(source - self.starts, lengths)
        return out

    def column(self, name: str) -> np.ndarray:
        """Column ``name`` of the batch, packed (a new array; one fancy index)."""
        try:
            col = self.batch.columns[name]
        except KeyError:
            raise KeyError(f"batch has no column {name!r} (it has {sorted(self.batch.columns)})") from None
        out: np.ndarray = col[self.index]
        return out

    def position_ids(self) -> np.ndarray:
        """int64 [num_tokens]: 0, 1, ... within each sample, restarting at every sample."""
        out: np.ndarray = np.arange(self.num_tokens, dtype=np.int64) - np.repeat(self.starts, self.lengths)
        return out

    def scalar(self, name: str, dtype: str = "float32") -> np.ndarray:
        """Per-sample scalar ``name`` (e.g. ``advantage``) repeated over each sample's packed tokens."""
        values = np.asarray(self.batch.scalars[name], dtype=dtype)
        return np.repeat(values[self.samples], self.lengths)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every column of the batch packed (token columns and ``routed_experts`` if present), and
        ``position_ids``."""
        out = {name: self.column(name) for name in self.batch.columns}
        out["position_ids"] = self.position_ids()
        return out


@dataclass(frozen=True)
class RankBatches:
    """The micro-batches of one data-parallel rank, in the order it should run them."""

    rank: int
    micro_batches: list[MicroBatch]

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)


@dataclass(frozen=True)
class Packing:
    """Where every sample of a batch goes. ``ranks[r].micro_batches`` all have the same length."""

    seq_len: int
    ranks: list[RankBatches]
    truncated: np.ndarray  # int64 indices of samples cut to seq_len
    rejected: np.ndarray  # int64 indices of samples dropped for being longer than seq_len

    @property
    def num_truncated(self) -> int:
        return int(self.truncated.size)

    @property
    def num_rejected(self) -> int:
        return int(self.rejected.size)

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0].micro_batches)


def pack(batch: Batch, seq_len: int, dp: int = 1, *, seed: int = 0, overlong: Overlong = "truncate") -> Packing:
    """Pack ``batch`` into micro-batches of at most ``seq_len`` tokens for ``dp`` ranks (see module doc)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if overlong not in ("truncate", "reject"):
        raise ValueError(f"overlong must be 'truncate' or 'reject', got {overlong!r}")
    lengths = np.diff(batch.offsets)
    too_long = np.flatnonzero(lengths > seq_len)
    keep = np.ones(lengths.size, dtype=bool)
    if overlong == "reject":
        keep[too_long] = False
    used = np.minimum(lengths, seq_len)
    rng = np.random.default_rng(seed)
    tiebreak = rng.permutation(lengths.size)
    order = np.lexsort((tiebreak, -used))  # longest first; equal lengths in seeded order
    order = order[keep[order]]

    rank_of = _assign_ranks(used[order], dp)
    per_rank = [_first_fit_decreasing(batch, order[rank_of == r], used, seq_len) for r in range(dp)]
    width = max((len(mbs) for mbs in per_rank), default=0)
    empty = np.zeros(0, dtype=np.int64)
    ranks = [RankBatches(r, mbs + [MicroBatch(batch, empty, empty, empty) for _ in range(width - len(mbs))])
             for r, mbs in enumerate(per_rank)]
    truncated = too_long if overlong == "truncate" else empty
    rejected = too_long if overlong == "reject" else empty
    return Packing(seq_len, ranks, truncated.astype(np.int64), rejected.astype(np.int64))


def _assign_ranks(sizes: np.ndarray, dp: int) -> np.ndarray:
    """Rank of each sample (given longest first): the rank with the fewest tokens so far."""
    loads = [(0, r) for r in range(dp)]
    out = np.empty(sizes.size, dtype=np.int64)
    for i, size in enumerate(sizes.tolist()):
        load, r = heapq.heappop(loads)
        out[i] = r
        heapq.heappush(loads, (load + size, r))
    return out


def _first_fit_decreasing(batch: Batch, samples: np.ndarray, used: np.ndarray, seq_len: int) -> list[MicroBatch]:
    """``samples`` (longest first) into bins of ``seq_len`` tokens: each into the first bin it fits."""
    sizes = used[samples]
    room = np.full(samples.size, seq_len, dtype=np.int64)  # at most one bin per sample
    bin_of = np.empty(samples.size, dtype=np.int64)
    bins = 0
    for i, size in enumerate(sizes.tolist()):
        fits = np.flatnonzero(room[:bins] >= size)
        b = int(fits[0]) if fits.size else bins
        bins = max(bins, b + 1)
        room[b] -= size
        bin_of[i] = b
    grouped = np.argsort(bin_of, kind="stable")  # by bin, then in placement order
    bounds = np.searchsorted(bin_of[grouped], np.arange(bins + 1))
    out = []
    for b in range(bins):
        members = grouped[bounds[b]:bounds[b + 1]]
        ends = np.cumsum(sizes[members])
        out.append(MicroBatch(batch, samples[members].astype(np.int64), ends - sizes[members], ends))
    return out
