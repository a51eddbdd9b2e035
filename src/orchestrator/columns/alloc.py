"""``SpanAllocator``: byte ranges of one fixed-size pool, taken and given back in any order. No I/O.

A worker's rollouts leave its pool in no particular order (a failed or filtered rollout at once, a trained one
when the trainer acknowledges its step, a straggler of a cancelled group whenever the orchestrator drops it),
so the step pool's ring (shm.py ``SpanRing``, freed in step order) does not fit. This is first fit over a list
of free ranges kept sorted by start and merged with their neighbours on every free: ``take`` and ``give`` are
O(free ranges), which stay few (at most one more than the live spans). Every range starts and ends at a
multiple of ``ALIGN``. The bound: at most ``capacity`` bytes are taken at once; ``take`` says None (never waits)
when no free range fits, and the caller decides whether to wait for a ``give``.
"""

from __future__ import annotations

from bisect import bisect_left

from orchestrator.columns.layout import ALIGN, align


class SpanAllocator:
    def __init__(self, capacity: int) -> None:
        if capacity < ALIGN or capacity % ALIGN:
            raise ValueError(f"a pool of {capacity} bytes: expected a positive multiple of {ALIGN}")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # (start, end), sorted, never adjacent
        self._taken: dict[int, int] = {}  # start -> end

    @property
    def taken_bytes(self) -> int:
        return sum(end - start for start, end in self._taken.items())

    @property
    def spans(self) -> int:
        return len(self._taken)

    @property
    def free_ranges(self) -> tuple[tuple[int, int], ...]:
        """The free ``(start, end)`` ranges, in order (their count shows fragmentation)."""
        return tuple(self._free)

    @property
    def taken_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(sorted(self._taken.items()))

    @property
    def largest_free(self) -> int:
        return max((end - start for start, end in self._free), default=0)

    def take(self, nbytes: int) -> int | None:
        """The start of a new range of ``nbytes`` (rounded up to ALIGN; at least ALIGN), or None while no free
        range is that large."""
        size = max(align(nbytes), ALIGN)
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, end)
                self._taken[start] = start + size
                return start
        return None

    def give(self, start: int) -> int:
        """Give back the range taken at ``start``; its size in bytes. KeyError if none was taken there."""
        end = self._taken.pop(start)
        i = bisect_left(self._free, (start, end))
        merged_start, merged_end = start, end
        if i < len(self._free) and self._free[i][0] == end:  # the next free range touches it
            merged_end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # so does the previous one
            merged_start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (merged_start, merged_end))
        return end - start

    def give_all(self) -> None:
        self._free = [(0, self.capacity)]
        self._taken.clear()
