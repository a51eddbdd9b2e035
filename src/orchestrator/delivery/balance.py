"""Packing one step into per-rank micro-batches the way prime-rl's trainer expects them. Plans only: no copies.

``pack_ranks(batch, seq_len, ranks, pad_to_multiple_of=P)`` places every sample of ``batch`` as prime-rl's
orchestrator does (``prepare_batch`` in ``src/prime_rl/trainer/batch.py``, prime-rl 559b447), for the prime-rl
transport and for any trainer using this library:

1. **Truncate** each sample to its first ``seq_len`` tokens.
2. **First-fit decreasing**: samples by length, longest first (equal lengths keep batch order), each into the
   first bin, in creation order, whose length plus its own is at most ``seq_len``; else a new bin.
3. **Split** (``ranks`` > 1) until there are at least ``ranks`` bins, rounded up to a multiple of ``ranks``:
   take the bin with the largest ``(cost, position)`` among bins of more than one sample; walk its samples by
   cost, heaviest first, each to the lighter side (the left one on ties); the left half takes the bin's place,
   the right half goes last. Stop early when no bin has two samples.
4. **Pad** each micro-batch to a multiple of ``P``: the pad tokens count in the last sample's segment
   (``sequence_lengths[-1]`` grows) but their positions restart at 0; ``P`` = 1 pads nothing.
5. **Dummies**: if the count is still not a multiple of ``ranks``, copies of the first micro-batch, padding
   included, with no loss (mask False, advantages 0), fill it up.
6. **Balance**: Karmarkar-Karp largest differencing splits the micro-batches into ``ranks`` sets of equal count
   by cost, then the best single swap between two ranks is applied while one lowers (max load, spread);
   set i goes to rank i. Every rank gets the same number of micro-batches, at least one.

``bin_cost(lengths)`` scores a micro-batch: prime-rl estimates forward FLOPs from the model's HF config
(``a * sum(L) + b * sum(L^2)``) and falls back to the token count when it cannot load one; the default here is
the token count. It changes which rank gets what, never what is trained. A step without samples gives each rank
one micro-batch of ``P`` pad tokens and no loss, so that every rank still steps together.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from orchestrator.contracts.wire import Batch

BinCost = Callable[[Sequence[int]], int]


def token_count(lengths: Sequence[int]) -> int:
    """The default ``bin_cost``: tokens (prime-rl's cost without a model config)."""
    return sum(lengths)


@dataclass(frozen=True, eq=False)
class PackedMicroBatch:
    """Samples ``samples`` of ``batch`` (indices, in packed order) packed into one sequence: sample j contributes
    its first ``lengths[j]`` tokens, then ``pad`` pad tokens follow. A ``dummy`` has no loss."""

    batch: Batch = field(repr=False)
    samples: np.ndarray  # int64 [k]
    lengths: np.ndarray  # int64 [k]
    pad: int = 0
    dummy: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum()) + self.pad

    @property
    def sequence_lengths(self) -> list[int]:
        """Each sample's segment; the pad tokens count in the last one."""
        out = [int(n) for n in self.lengths]
        if self.pad:  # a micro-batch of pads alone (a step without samples) is one segment of pads
            out = [*out[:-1], out[-1] + self.pad] if out else [self.pad]
        return out

    @property
    def index(self) -> np.ndarray:
        """int64 [real tokens]: each packed token's row in the batch's columns (pads excluded)."""
        starts = np.repeat(self.batch.offsets[self.samples] - _starts(self.lengths), self.lengths)
        out: np.ndarray = np.arange(int(self.lengths.sum()), dtype=np.int64) + starts
        return out

    def position_ids(self) -> np.ndarray:
        """int64 [num_tokens]: 0, 1, ... within each sample, and again from 0 over the pad tokens."""
        real = int(self.lengths.sum())
        within: np.ndarray = np.arange(real, dtype=np.int64) - np.repeat(_starts(self.lengths), self.lengths)
        return np.concatenate([within, np.arange(self.pad, dtype=np.int64)])

    def column(self, name: str, pad_value: float = 0) -> np.ndarray:
        """Column ``name`` packed (one fancy index), with ``pad`` rows of ``pad_value`` after it."""
        col = self.batch.columns[name]
        padding = np.full((self.pad, *col.shape[1:]), pad_value, dtype=col.dtype)
        return np.concatenate([col[self.index], padding])

    def per_token(self, values: Sequence[float] | np.ndarray, pad_value: float, dtype: str = "float64") -> np.ndarray:
        """A per-sample value (one per sample of the batch) repeated over each sample's tokens, then the pads."""
        v = np.asarray(values, dtype=dtype)[self.samples] if self.samples.size else np.zeros(0, dtype)
        return np.concatenate([np.repeat(v, self.lengths), np.full(self.pad, pad_value, dtype=dtype)])

    def loss_mask(self) -> np.ndarray:
        """bool [num_tokens]: the batch's loss mask; False on pads, everywhere for a dummy."""
        if self.dummy:
            return np.zeros(self.num_tokens, dtype=bool)
        return np.concatenate([self.batch.columns["loss_mask"][self.index] != 0, np.zeros(self.pad, dtype=bool)])

    def advantages(self, scalar: str = "advantage") -> np.ndarray:
        """float64 [num_tokens]: the sample's advantage on its loss-mask tokens, 0.0 elsewhere (a sample whose
        advantage is None has none)."""
        values = [0.0 if a is None else float(a) for a in self.batch.scalars[scalar]]
        return np.where(self.loss_mask(), self.per_token(values, 0.0), 0.0)


def _starts(lengths: np.ndarray) -> np.ndarray:
    out: np.ndarray = np.cumsum(lengths) - lengths
    return out


def pack_ranks(batch: Batch, seq_len: int, ranks: int, *, pad_to_multiple_of: int = 1,
               bin_cost: BinCost = token_count) -> list[list[PackedMicroBatch]]:
    """One list of micro-batches per rank, all of the same length (see the module docstring)."""
    if seq_len < 1 or ranks < 1 or pad_to_multiple_of < 1:
        raise ValueError(f"seq_len, ranks and pad_to_multiple_of must be >= 1, got {seq_len}, {ranks}, "
                         f"{pad_to_multiple_of}")
    if batch.num_samples == 0:
        empty = np.zeros(0, dtype=np.int64)
        return [[PackedMicroBatch(batch, empty, empty, pad_to_multiple_of, dummy=True)] for _ in range(ranks)]
    used = np.minimum(np.diff(batch.offsets), seq_len)
    bins = _first_fit_decreasing(used.tolist(), seq_len)
    if ranks > 1:
        _split(bins, max(-(-len(bins) // ranks) * ranks, ranks), used.tolist(), bin_cost)
    mbs = [PackedMicroBatch(batch, np.array(b, dtype=np.int64), used[b].astype(np.int64)) for b in bins]
    mbs = [_padded(mb, pad_to_multiple_of) for mb in mbs]
    if len(mbs) % ranks:
        first = mbs[0]
        mbs += [PackedMicroBatch(batch, first.samples, first.lengths, first.pad, dummy=True)] * (-len(mbs) % ranks)
    parts = balanced_partition([bin_cost(mb.sequence_lengths) for mb in mbs], ranks)
    return [[mbs[i] for i in part] for part in parts]


def _padded(mb: PackedMicroBatch, multiple: int) -> PackedMicroBatch:
    pad = -mb.num_tokens % multiple
    return mb if multiple == 1 or pad == 0 else PackedMicroBatch(mb.batch, mb.samples, mb.lengths, pad)


def _first_fit_decreasing(used: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per bin: longest first (stable), each into the first bin it fits."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(used)), key=lambda j: -used[j]):
        for b, free in enumerate(room):
            if used[i] <= free:
                bins[b].append(i)
                room[b] -= used[i]
                break
        else:
            bins.append([i])
            room.append(seq_len - used[i])
    return bins


def _split(bins: list[list[int]], target: int, used: list[int], cost: BinCost) -> None:
    """Split bins in place until there are ``target`` (or no bin has two samples)."""
    while len(bins) < target:
        candidates = [(cost([used[i] for i in b]), pos) for pos, b in enumerate(bins) if len(b) > 1]
        if not candidates:
            return
        _, pos = max(candidates)
        left: list[int] = []
        right: list[int] = []
        left_cost = right_cost = 0
        for i in sorted(bins[pos], key=lambda j: -cost([used[j]])):
            if left_cost <= right_cost:
                left.append(i)
                left_cost += cost([used[i]])
            else:
                right.append(i)
                right_cost += cost([used[i]])
        bins[pos] = left
        bins.append(right)


def balanced_partition(weights: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``weights`` in ``parts`` sets of equal count and near-equal total (``len(weights)`` must be a
    positive multiple of ``parts``): Karmarkar-Karp, then single swaps while they lower (max load, spread)."""
    if not weights or len(weights) % parts:
        raise ValueError(f"{len(weights)} items do not split into {parts} sets of equal count")
    return _refine(weights, _karmarkar_karp(weights, parts))


class _Set:
    __slots__ = ("items", "total")

    def __init__(self) -> None:
        self.total = 0
        self.items: list[int] = []

    def __lt__(self, other: _Set) -> bool:
        return (self.total, self.items) < (other.total, other.items)


class _State:
    """One partial partition; the heap pops the one with the largest spread first (ties: larger first set)."""

    def __init__(self, chunk: list[tuple[int, int]], parts: int) -> None:
        self.sets = [_Set() for _ in range(parts)]
        for s, (weight, idx) in zip(self.sets, chunk, strict=False):
            s.items.append(idx)
            s.total += weight
        self.sets.sort(reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].total - self.sets[-1].total

    def merge(self, other: _State) -> None:
        """Pair the heaviest set here with the lightest there, and so on."""
        for mine, theirs in zip(self.sets, reversed(other.sets), strict=True):
            mine.items.extend(theirs.items)
            mine.total += theirs.total
        self.sets.sort(reverse=True)

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return other.sets[0] < self.sets[0]


def _karmarkar_karp(weights: Sequence[int], parts: int) -> list[list[int]]:
    ordered = sorted((w, i) for i, w in enumerate(weights))
    heap: list[_State] = []
    for at in range(0, len(ordered), parts):
        heapq.heappush(heap, _State(ordered[at:at + parts], parts))
    while len(heap) > 1:
        state = heapq.heappop(heap)
        state.merge(heapq.heappop(heap))
        heapq.heappush(heap, state)
    return [sorted(s.items) for s in heap[0].sets]


def _refine(weights: Sequence[int], partitions: list[list[int]]) -> list[list[int]]:
    """Apply the single swap between two sets that lowers (max load, spread) most, until none does."""
    loads = [sum(weights[i] for i in p) for p in partitions]
    while True:
        best: tuple[int, int, int, int, list[int]] | None = None
        best_score = (max(loads), max(loads) - min(loads))
        for a in range(len(partitions)):
            for b in range(a + 1, len(partitions)):
                for pa, ia in enumerate(partitions[a]):
                    for pb, ib in enumerate(partitions[b]):
                        new = list(loads)
                        new[a] += weights[ib] - weights[ia]
                        new[b] += weights[ia] - weights[ib]
                        score = (max(new), max(new) - min(new))
                        if score < best_score:
                            best_score, best = score, (a, b, pa, pb, new)
        if best is None:
            return partitions
        a, b, pa, pb, loads = best
        partitions[a][pa], partitions[b][pb] = partitions[b][pb], partitions[a][pa]
