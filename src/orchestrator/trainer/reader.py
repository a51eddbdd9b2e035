"""The trainer library's side of the data plane, same node: a step manifest in, numpy views of the workers' pools out.

``PoolMaps`` holds this process's read-only mappings of env workers' column pools, by pool id. ``adopt(id,
size, fd)`` maps a pool from an fd the caller has (checked: sealed, of that size); ``fetch(ref)`` gets the fd
from the Unix socket the manifest names (memfd.map_served_pool: blocking, briefly; call it off an event loop
that may serve the pool). ``view(manifest)`` fetches what is missing, and returns a ``StepView``: every sample's
columns as read-only numpy views of the mappings, no byte copied. A manifest naming a newer pool of a worker
(it renewed its pool: an orchestrator restarted) drops the older mapping; the kernel unmaps it once no view
of it is left, and frees the memory once the worker has let go of it too.

Views stay valid as long as they live (the mapping does), even after the worker dies; but the worker reuses
a span once the orchestrator releases it, which it does when the trainer acknowledges the step: read (or
copy) a step's arrays before acknowledging it. A sample whose ``min_version`` scalar is set gets a loss mask with 0
on every token older than it (its env's ``max_token_lag``, columns/versions.py): a copy of that one column, the
rest stays views; the through plane's batches come with that mask already applied. ``StepView.gather()`` makes
the through path's contiguous ``Batch`` with one copy per column, for trainers that want it;
``transport.packing.pack`` works on it.

Pools on another host (``PoolRef.host``) with a span server (``PoolRef.address``) are not mapped: ``view``
fetches the step's spans from it (trainer/fetch.py; blocking, at most ``fetch_timeout_s`` per pool) and the
views are of the fetched frames (a worker runs a span server with ``env-worker --span-address``). A pool on
another host without one cannot be read: a lost step, naming the pool. ``read(ref, spans)`` gives the bytes of
some spans of one pool the same way (the orchestrator's step dumps and samples table: dataplane/readback.py).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from orchestrator.columns.versions import mask_older
from orchestrator.contracts.manifest import PoolRef, StepManifest
from orchestrator.errors import WireError
from orchestrator.security import ClientKeys, KeyPair
from orchestrator.trainer.fetch import SPAN_FETCH_TIMEOUT_S, SpanClient

if TYPE_CHECKING:
    from orchestrator.contracts.wire import Batch, LogprobsMode

# orchestrator.transport's receiver imports this module, and importing any module of that package loads the
# package (its __init__ imports the receiver): so this module imports transport's memfd and wire where it uses
# them, never at import time, and can be imported first, last or alone.

log = logging.getLogger(__name__)

_OWN_VERSIONS = "_own_versions"  # a span's versions, read for the loss mask only (the step does not carry them)


@dataclass
class _Mapped:
    map: mmap.mmap
    view: memoryview


class PoolsLost(WireError):
    """A manifest names pools this reader cannot map (their worker died or replaced them before this reader
    mapped them): ``pools``, their ids. The step cannot be read whole: the receiver reports it lost."""

    def __init__(self, step: int, attempt: int, pools: list[str], why: str) -> None:
        super().__init__(f"step {step} (attempt {attempt}): cannot map column pools {pools}: {why}")
        self.step, self.attempt, self.pools = step, attempt, pools


class PoolMaps:
    """See the module docstring. ``host``: this node's name, as workers report theirs (default: hostname);
    ``fetch_timeout_s``: the bound on fetching one pool's spans of a step from another host."""

    def __init__(self, host: str | None = None, fetch_timeout_s: float = SPAN_FETCH_TIMEOUT_S,
                 keys: KeyPair | None = None) -> None:
        self.host = host or socket.gethostname()
        self.keys = keys  # this reader's key pair: for span servers that are CURVE
        self.fetch_timeout_s = fetch_timeout_s
        self.fetches = 0
        self.remote_fetches = 0  # requests to span servers on other hosts
        self._pools: dict[str, _Mapped] = {}  # pool id -> its mapping
        self._by_worker: dict[str, str] = {}  # worker -> the pool id it has now
        self._spans = SpanClient()  # one connection per span server, kept from step to step

    def __contains__(self, pool_id: str) -> bool:
        return pool_id in self._pools

    def adopt(self, pool_id: str, size: int, fd: int) -> None:
        """Map the pool behind ``fd`` (the caller keeps the fd); WireError unless it is a sealed ``size``-byte
        memfd."""
        from orchestrator.columns.memfd import SEALS  # not at import time: see the imports

        try:
            if os.fstat(fd).st_size != size or fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                raise WireError(f"pool {pool_id}: fd {fd} is not a sealed {size}-byte memfd")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except OSError as e:
            raise WireError(f"pool {pool_id}: cannot map fd {fd}: {e}") from None
        self._pools[pool_id] = _Mapped(mapping, memoryview(mapping))

    def fetch(self, ref: PoolRef) -> None:
        """Blocking, briefly: map ``ref``'s pool from the socket it names. WireError if it is on another host,
        names no socket, or cannot be had."""
        if ref.host != self.host or ref.path is None:
            raise WireError(f"pool {ref.id} of env worker {ref.worker} is on host {ref.host} (this is {self.host}) "
                            "and names no span server, or names no socket")
        from orchestrator.columns.memfd import map_served_pool  # not at import time: see the imports

        mapping = map_served_pool(ref.path, ref.id, ref.size)
        self._pools[ref.id] = _Mapped(mapping, memoryview(mapping))
        self.fetches += 1
        log.info("mapped column pool %s of env worker %s (%d MB)", ref.id, ref.worker, ref.size >> 20)

    def remote(self, ref: PoolRef) -> bool:
        """Whether ``ref``'s spans are fetched from its span server (another host) rather than mapped."""
        return ref.host != self.host and ref.address is not None

    def announce(self, ref: PoolRef) -> None:
        """``ref`` is its worker's pool now: map it (blocking, briefly, unless mapped already, or on another host
        with a span server: nothing to map); an older pool of the same worker is dropped (it renewed its pool:
        the old one is never named again). WireError as ``fetch``."""
        if self.remote(ref):
            return
        old = self._by_worker.get(ref.worker)
        if old is not None and old != ref.id:
            self._drop(old)
        self._by_worker[ref.worker] = ref.id
        if ref.id not in self._pools:
            self.fetch(ref)
        elif len(self._pools[ref.id].view) != ref.size:
            raise WireError(f"pool {ref.id}: announced as {ref.size} bytes, the mapping has "
                            f"{len(self._pools[ref.id].view)}")

    def missing(self, manifest: StepManifest) -> list[PoolRef]:
        """The pools ``manifest`` names that are not mapped yet (``view`` fetches them: blocking)."""
        return [ref for ref in manifest.pools if ref.id not in self._pools]

    def view(self, manifest: StepManifest) -> StepView:
        """Views of every sample of ``manifest`` (fetching the pools not mapped yet: blocking, briefly).
        PoolsLost naming every pool that cannot be mapped (each is tried)."""
        lost: list[str] = []
        why = ""
        fetched: dict[int, memoryview] = {}  # span index -> its bytes, for pools on other hosts
        for p, ref in enumerate(manifest.pools):
            try:
                if self.remote(ref):
                    fetched.update(self._fetch_spans(manifest, p, ref))
                else:
                    self.announce(ref)
            except WireError as e:
                lost.append(ref.id)
                why = why or str(e)
        if lost:
            raise PoolsLost(manifest.step, manifest.attempt, lost, why)
        spans = [self._span_columns(manifest, i, fetched) for i in range(len(manifest.spans))]
        return StepView(manifest, spans)

    def read(self, ref: PoolRef, spans: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Blocking, briefly: the bytes of ``spans`` ((offset, nbytes) pairs) of pool ``ref``: views of its
        mapping (mapped first if it is not), or fetched from its span server if it is on another host. WireError
        when they cannot be had; ValueError for a span outside the pool."""
        if self.remote(ref):
            return self._fetch(ref, spans)
        self.announce(ref)
        view = self._pools[ref.id].view
        for offset, nbytes in spans:
            if offset < 0 or nbytes < 0 or offset + nbytes > len(view):
                raise ValueError(f"span [{offset}, {nbytes}] is not inside pool {ref.id} ({len(view)} bytes)")
        return [view[offset:offset + nbytes] for offset, nbytes in spans]

    def _fetch_spans(self, m: StepManifest, p: int, ref: PoolRef) -> dict[int, memoryview]:
        """Blocking, at most ``fetch_timeout_s``: the bytes of every span of ``m`` in pool ``m.pools[p]``, from
        its span server, by span index. WireError when they cannot be had (a lost step)."""
        index = [i for i, s in enumerate(m.spans) if s.pool == p]
        spans = [(m.spans[i].offset, m.spans[i].layout().nbytes) for i in index]
        return dict(zip(index, self._fetch(ref, spans), strict=True))

    def _fetch(self, ref: PoolRef, spans: Sequence[tuple[int, int]]) -> list[memoryview]:
        assert ref.address is not None
        keys = None
        if ref.public_key is not None:
            if self.keys is None:
                raise WireError(f"pool {ref.id}: its span server {ref.address} is CURVE; this trainer has no key "
                                "pair (give the receiver keys=)")
            keys = ClientKeys(ref.public_key.encode(), self.keys)
        got = self._spans.fetch(ref.address, ref.id, spans, self.fetch_timeout_s, keys)
        self.remote_fetches += 1
        return got

    def _span_columns(self, m: StepManifest, i: int, fetched: dict[int, memoryview]) -> dict[str, np.ndarray]:
        """The columns of span ``i`` the step carries, as read-only views of its pool's mapping, or of its
        ``fetched`` bytes (``check_manifest`` has checked the span lies inside its pool); and its own ``versions``
        when the span has them and the step does not (a step of spans that do not all have them), for the mask."""
        s = m.spans[i]
        region, base = (fetched[i], 0) if i in fetched else (self._pools[m.pools[s.pool].id].view, s.offset)
        layout = s.layout()
        out: dict[str, np.ndarray] = {}
        specs = [(c.name, np.dtype(c.dtype), c.tail) for c in m.columns]
        if "versions" in s.optional and all(c.name != "versions" for c in m.columns):
            specs.append((_OWN_VERSIONS, layout.dtype("versions"), []))
        for name, dtype, tail in specs:
            offset, nbytes = layout.columns[name.removeprefix("_own_")]
            at = base + offset
            out[name] = np.frombuffer(region[at:at + nbytes], dtype).reshape(s.tokens, *tail)
        return out

    def _drop(self, pool_id: str) -> None:
        mapped = self._pools.pop(pool_id, None)
        if mapped is None:
            return
        mapped.view.release()
        try:
            mapped.map.close()
        except BufferError:  # views of it are still alive: it is unmapped when they go
            pass

    def close(self) -> None:
        for pool_id in list(self._pools):
            self._drop(pool_id)
        self._spans.close()


class StepView:
    """One step's samples as views of the workers' pools: ``sample(i)`` -> columns and scalars, no copies."""

    def __init__(self, manifest: StepManifest, spans: list[dict[str, np.ndarray]]) -> None:
        self.manifest = manifest
        self._spans = spans

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def num_samples(self) -> int:
        return len(self.manifest.samples)

    @property
    def logprobs_mode(self) -> LogprobsMode | None:
        """Which logprobs the ``logprobs`` column holds (``Batch.logprobs_mode``)."""
        return self.manifest.logprobs_mode

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i``: each column's tokens ``start:start + tokens`` of its span (views), and its scalars (the
        loss mask a copy with stale tokens masked, when its ``min_version`` masks any)."""
        ref = self.manifest.samples[i]
        span = self._spans[ref.span]
        out: dict[str, Any] = {name: col[ref.start:ref.start + ref.tokens] for name, col in span.items()}
        out.update({k: v[i] for k, v in self.manifest.scalars.items()})
        versions = out.pop(_OWN_VERSIONS, out.get("versions"))
        floor = out.get("min_version")
        if floor is not None and versions is not None:
            out["loss_mask"] = mask_older(out["loss_mask"], versions, np.array([0, ref.tokens]), [floor])
        return out

    def gather(self) -> Batch:
        """The step as the through path's contiguous ``Batch``: one copy per column (the trainer's, not the
        orchestrator's)."""
        from orchestrator.contracts.wire import Batch  # not at import time: see the imports

        m = self.manifest
        names = [c.name for c in m.columns]
        floors = m.scalars.get("min_version") or [None] * len(m.samples)
        chunks = {name: [self._spans[ref.span][name][ref.start:ref.start + ref.tokens] for ref in m.samples]
                  for name in names}
        for i, floor in enumerate(floors):  # the samples with a floor: their loss mask, masked (a copy of it)
            if floor is not None:
                chunks["loss_mask"][i] = self.sample(i)["loss_mask"]
        return Batch.from_columns(m.run, m.step, chunks, [ref.tokens for ref in m.samples],
                                  {k: list(v) for k, v in m.scalars.items()}, m.logprobs_mode)
