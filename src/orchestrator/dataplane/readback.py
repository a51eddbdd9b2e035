"""Direct mode: the two opt-in places where the orchestrator reads column bytes, a step dump and the samples
table (docs/data-plane.md, "What the orchestrator sees of a rollout").

Everything else the orchestrator does in direct mode reads headers only. A due dump needs the step's columns
and every record's; a samples table needs the token ids and loss mask of a few rollouts. ``Readback`` reads
them from the env workers' pools as a trainer would (``PoolMaps.read``: a pool on this host mapped read-only,
one on another host fetched from its span server) and hands back copies of the records that look like the
through path's (column frames, no span), so ``write_dump``, replays and ``SampleTable`` work unchanged.

Blocking: call it off the event loop, in the step thread, before the step is sent and before any of its
rollouts is released: a released span may be rewritten at once. The copies are the step's to drop. Each call
maps (or fetches) what it reads and lets go of it before it returns, so this process's RSS never holds pool
pages between steps; a fetch from another host waits at most READBACK_TIMEOUT_S.

A record whose pool is gone (or cannot be read) is left as it was, without columns, with one warning per
worker; the samples table skips it, and a dump whose batch cannot be read is not written (``batch`` raises
``WireError``; the caller logs it and the run goes on).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec

from orchestrator.columns.layout import shapes_layout
from orchestrator.contracts.manifest import StepManifest, pool_ref
from orchestrator.contracts.protocol import PoolInfo, RolloutRecord
from orchestrator.errors import WireError
from orchestrator.security import KeyPair
from orchestrator.trainer.reader import PoolMaps

if TYPE_CHECKING:
    from orchestrator.contracts.wire import Batch
    from orchestrator.rollouts.groups import Group

log = logging.getLogger(__name__)

READBACK_TIMEOUT_S = 5.0  # a fetch from another host, in the step thread: a dump or a table is not worth more


class Readback:
    """See the module docstring. ``keys``: this process's key pair, for CURVE span servers."""

    def __init__(self, keys: KeyPair | None = None) -> None:
        self.keys = keys

    def _maps(self) -> PoolMaps:
        return PoolMaps(fetch_timeout_s=READBACK_TIMEOUT_S, keys=self.keys)

    def records(self, records: Iterable[RolloutRecord], pools: Mapping[str, PoolInfo]) -> dict[str, RolloutRecord]:
        """Copies of ``records`` with their columns as frames, by rollout id; records without a span, or whose
        span is not in its worker's current pool (``pools``, by worker), or whose pool cannot be read, are
        left out."""
        by_worker: dict[str, list[RolloutRecord]] = {}
        for r in records:
            info = pools.get(r.header.worker)
            if r.header.span is not None and info is not None and info.id == r.header.span.pool:
                by_worker.setdefault(r.header.worker, []).append(r)
        out: dict[str, RolloutRecord] = {}
        maps = self._maps()
        try:
            for worker, recs in by_worker.items():
                try:
                    spans = maps.read(pool_ref(worker, pools[worker]),
                                      [(r.header.span.offset, r.header.span.nbytes) for r in recs if r.header.span])
                except (WireError, ValueError) as e:
                    log.warning("could not read the columns of %d rollout(s) in env worker %s's pool: %s",
                                len(recs), worker, e)
                    continue
                for r, span in zip(recs, spans, strict=True):
                    out[r.rid] = as_through_record(r, span)
                del spans  # views of the mapping: gone before it is closed
        finally:
            maps.close()
        return out

    def groups(self, groups: Sequence[Group], pools: Mapping[str, PoolInfo], *, limit: int | None = None
               ) -> list[Group]:
        """Copies of ``groups`` whose records carry their columns: every record's, or (``limit``) only the first
        survivor with samples of each of the first ``limit`` groups that have one (what a samples table shows)."""
        if limit is None:
            wanted: list[RolloutRecord] = [r for g in groups for r in g.records]
        else:
            firsts = (next((r for r in g.survivors if r.header.samples), None) for g in groups)
            wanted = [r for r in firsts if r is not None][:limit]
        read = self.records(wanted, pools)
        return [dataclasses.replace(g, records=[read.get(r.rid, r) for r in g.records]) for g in groups]

    def batch(self, manifest: StepManifest) -> Batch:
        """The step the manifest names, gathered as the trainer's ``recv()`` gathers it (copies). WireError
        (``PoolsLost``) when some pool cannot be read."""
        maps = self._maps()
        try:
            return maps.view(manifest).gather()
        finally:
            maps.close()


def as_through_record(record: RolloutRecord, span: memoryview) -> RolloutRecord:
    """``record`` as the through path carries it: its span's bytes copied into its column frames."""
    h = record.header
    layout = shapes_layout(list(h.samples), h.routed_dtype, h.optional)
    frames = []
    for name in record.columns:
        offset, nbytes = layout.columns[name]
        frames.append(memoryview(bytes(span[offset:offset + nbytes])))
    return RolloutRecord(msgspec.structs.replace(h, span=None, frames=len(frames)), frames)
