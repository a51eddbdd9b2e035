"""The step manifest: one step as the orchestrator sends it when the columns stay in the env workers' pools.

It is built from record headers alone (``build_manifest``, in the step thread) and says, for the trainer
library, where every sample's bytes are: ``pools`` (one per worker holding some: its id, size, host, and the
Unix socket that hands out its fd), ``spans`` (one per trained rollout: pool, byte offset, tokens, routed
shape and dtype, the optional token columns it has; the column layout inside follows from those,
columns/layout.py), ``samples`` (span, first token, tokens; in span order, each inside its span, one after another:
a span's samples cover its tokens, but for a sample left out because ``max_token_lag`` left it nothing to train),
``columns`` (name, dtype and trailing shape of every column the trainer gets: the required token
columns, the optional ones every span has, plus routed experts when every span has the same routed shape and
dtype), ``scalars`` (per sample: ``advantage``, ``reward``, ``env``, ``rollout``, ``policy``, ``policy_max``
(the newest weights its bounded tokens may be of), ``min_version`` (its env's ``max_token_lag`` floor, or null: the
reader masks older tokens out of the loss, columns/versions.py), and ``temperature`` when the orchestrator gives it),
``logprobs_mode`` (``raw`` or ``processed``: which logprobs the logprobs column
holds, as in a batch header; null: not known), and ``attempt``: 0 for a step's first build, one more for each
rebuild after the trainer reported some of its pools lost. Encoded as one msgpack map with ``"kind":
"step-manifest"`` and ``"v": 2`` (docs/wire-format.md); a version 1 manifest (spans without optional columns)
is read too.

``decode_manifest`` is the trainer's edge: it refuses, with a ``WireError`` naming the first problem, anything
but a valid manifest of this version: a message over MAX_MANIFEST_BYTES, a wrong type or a value out of
bounds (msgspec), an unknown version, a span outside its pool or overlapping another, a sample outside its
span or before the one it follows, a span without a sample, columns that do not follow from the spans, scalars of
the wrong length, a non-finite advantage, a ``min_version`` that is not an int or null.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from orchestrator.columns.layout import (
    ALIGN,
    MAX_POOL_BYTES,
    MAX_ROUTED_DIM,
    ROUTED,
    ROUTED_DTYPES,
    TOKEN_DTYPES,
    Offset,
    PoolId,
    RoutedDtype,
    SpanLayout,
    column_names,
    shared_optional,
    span_layout,
)
from orchestrator.errors import WireError

if TYPE_CHECKING:
    from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord
    from orchestrator.contracts.wire import LogprobsMode

MANIFEST_VERSION: Literal[2] = 2  # 2: spans name their optional token columns; 1 is read as spans without any
READ_VERSIONS = (1, 2)
MAX_MANIFEST_BYTES = 64 << 20  # refused before decoding: a million-sample step takes ~40 MB
MAX_POOLS = 4096
MAX_SPANS = 1 << 20
MAX_SAMPLES = 1 << 22
MAX_SPAN_TOKENS = 1 << 24
MAX_ATTEMPTS = 64  # builds of one step (the first and its rebuilds after a trainer lost some of its pools)

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Index = Annotated[int, msgspec.Meta(ge=0, le=MAX_SAMPLES)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_SPAN_TOKENS)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROUTED_DIM)]
Scalar = float | int | str | bool | None


class PoolRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One worker's column pool: ``path`` serves its fd to a reader on ``host``; ``address``, when set, is its
    span server, where a reader on another host fetches its spans (trainer/fetch.py)."""

    worker: Name
    id: PoolId
    size: Annotated[int, msgspec.Meta(ge=ALIGN, le=MAX_POOL_BYTES)]
    host: Name
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=107)] | None = None
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None  # its span server (fetch.py)
    public_key: Annotated[str, msgspec.Meta(min_length=40, max_length=40)] | None = None  # that server's CURVE key


class SpanRef(msgspec.Struct, frozen=True, array_like=True):
    """One trained rollout's columns: at ``offset`` of ``pools[pool]``, in the layout of its numbers and optional
    columns (columns/layout.py ``span_layout``)."""

    pool: Index
    offset: Offset
    tokens: Tokens
    layers: Dim
    top_k: Dim
    routed_dtype: RoutedDtype
    rollout: Name
    optional: Annotated[list[Name], msgspec.Meta(max_length=8)] = []  # version 2; a version 1 span has none

    def layout(self) -> SpanLayout:
        """Where its columns lie, from its start (ValueError for an optional column this version does not know)."""
        return span_layout(self.tokens, self.layers, self.top_k, self.routed_dtype, self.optional)


class SampleRef(msgspec.Struct, frozen=True, array_like=True):
    """One sample: tokens ``start:start + tokens`` of ``spans[span]``, in every column."""

    span: Index
    start: Tokens
    tokens: Tokens


class ColumnSpec(msgspec.Struct, frozen=True, array_like=True):
    name: Name
    dtype: Annotated[str, msgspec.Meta(max_length=8)]  # numpy dtype.str, e.g. "<i4"
    tail: Annotated[list[Dim], msgspec.Meta(max_length=2)]  # shape after the token axis


class StepManifest(msgspec.Struct, frozen=True, kw_only=True, tag="step-manifest", tag_field="kind",
                   forbid_unknown_fields=True):
    v: Literal[1, 2] = MANIFEST_VERSION
    run: Name
    step: Annotated[int, msgspec.Meta(ge=0)]
    attempt: Annotated[int, msgspec.Meta(ge=0, lt=MAX_ATTEMPTS)] = 0  # > 0: rebuilt after the trainer lost pools
    pools: Annotated[list[PoolRef], msgspec.Meta(max_length=MAX_POOLS)]
    spans: Annotated[list[SpanRef], msgspec.Meta(max_length=MAX_SPANS)]
    samples: Annotated[list[SampleRef], msgspec.Meta(max_length=MAX_SAMPLES)]
    columns: Annotated[list[ColumnSpec], msgspec.Meta(max_length=8)]
    scalars: Annotated[dict[Name, Annotated[list[Scalar], msgspec.Meta(max_length=MAX_SAMPLES)]],
                       msgspec.Meta(max_length=64)]
    logprobs_mode: Literal["raw", "processed"] | None = None  # as a batch header's (contracts/wire.py)


class _Versioned(msgspec.Struct):
    kind: str = ""
    v: object = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepManifest)
_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def encode_manifest(m: StepManifest) -> bytes:
    return _encoder.encode(m)


def is_manifest(buf: bytes | memoryview) -> bool:
    """Whether a one-frame message claims to be a step manifest (its ``kind``), to tell it from a batch header
    before decoding either; anything undecodable is not (the batch decoder then names the problem)."""
    try:
        return _version_decoder.decode(buf).kind == "step-manifest"
    except (msgspec.DecodeError, UnicodeDecodeError):
        return False


def decode_manifest(buf: bytes | memoryview) -> StepManifest:
    """A valid manifest of this version, or WireError naming the first problem (see the module docstring)."""
    if len(buf) > MAX_MANIFEST_BYTES:
        raise WireError(f"step manifest of {len(buf)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
    try:
        head = _version_decoder.decode(buf)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec 0.22: a string not in UTF-8
        raise WireError(f"not a step manifest: {e}") from None
    if head.kind != "step-manifest" or head.v not in READ_VERSIONS:
        raise WireError(f"not a step manifest of version {' or '.join(map(str, READ_VERSIONS))}: kind {head.kind!r}, "
                        f"version {head.v!r}")
    try:
        m = _decoder.decode(buf)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # ValidationError included: types, bounds
        raise WireError(f"invalid step manifest: {e}") from None
    check_manifest(m)
    return m


def expected_columns(spans: Sequence[SpanRef]) -> list[ColumnSpec]:
    """The columns a step of ``spans`` has: the required token columns, the optional ones every span has, and
    routed experts when all spans agree on a nonzero routed shape and dtype (else the step carries none, as the
    through path's batch does)."""
    names = column_names(shared_optional(s.optional for s in spans))
    columns = [ColumnSpec(name, TOKEN_DTYPES[name].str, []) for name in names if name != ROUTED]
    routed = {(s.layers, s.top_k, s.routed_dtype) for s in spans}
    if len(routed) == 1 and (shape := routed.pop())[0] and shape[1]:
        columns.append(ColumnSpec(ROUTED, ROUTED_DTYPES[shape[2]].str, [shape[0], shape[1]]))
    return columns


def check_manifest(m: StepManifest) -> None:
    """WireError naming the first inconsistency of a manifest whose fields are each well typed."""
    where = f"step manifest (run {m.run}, step {m.step})"
    if len({p.id for p in m.pools}) != len(m.pools) or len({p.worker for p in m.pools}) != len(m.pools):
        raise WireError(f"{where}: a pool id or a worker appears twice in pools")
    if len({s.rollout for s in m.spans}) != len(m.spans):
        raise WireError(f"{where}: a rollout appears in two spans")
    ends: dict[int, list[tuple[int, int]]] = {}
    for i, s in enumerate(m.spans):
        if s.pool >= len(m.pools):
            raise WireError(f"{where}: span {i} names pool {s.pool} of {len(m.pools)}")
        if s.optional and m.v < 2:
            raise WireError(f"{where}: span {i} names optional columns in a version {m.v} manifest")
        try:
            size = s.layout().nbytes
        except ValueError as e:
            raise WireError(f"{where}: span {i}: {e}") from None
        if s.offset % ALIGN or s.offset + size > m.pools[s.pool].size:
            raise WireError(f"{where}: span {i} ({size} bytes at {s.offset}) is not an aligned range of its "
                            f"{m.pools[s.pool].size}-byte pool")
        ends.setdefault(s.pool, []).append((s.offset, s.offset + size))
    for pool, ranges in ends.items():
        ranges.sort()
        if any(a[1] > b[0] for a, b in itertools.pairwise(ranges)):
            raise WireError(f"{where}: spans overlap in pool {m.pools[pool].id}")
    _check_samples(m, where)
    if m.columns != expected_columns(m.spans):
        raise WireError(f"{where}: columns {[(c.name, c.dtype, c.tail) for c in m.columns]} do not follow from "
                        "its spans")
    for k, values in m.scalars.items():
        if len(values) != len(m.samples):
            raise WireError(f"{where}: scalar {k!r} has {len(values)} values for {len(m.samples)} samples")
    advantages = m.scalars.get("advantage")
    if advantages is None or not all(isinstance(a, int | float) and not isinstance(a, bool) and math.isfinite(a)
                                     for a in advantages):
        raise WireError(f"{where}: every sample needs a finite advantage")
    if not all(f is None or (isinstance(f, int) and not isinstance(f, bool)) for f in m.scalars.get("min_version", ())):
        raise WireError(f"{where}: min_version must be an int or null for every sample")


def _check_samples(m: StepManifest, where: str) -> None:
    """Samples come in span order, each inside its span after the previous one, and every span has one; in a
    version 1 manifest each span's samples cover its tokens exactly, one after another."""
    span, at = -1, 0
    for i, s in enumerate(m.samples):
        if s.span >= len(m.spans):
            raise WireError(f"{where}: sample {i} names span {s.span} of {len(m.spans)}")
        if s.span == span + 1 and (m.v >= 2 or span < 0 or at == m.spans[span].tokens):  # the next span begins
            span, at = s.span, 0
        exact = m.v < 2 and s.start != at
        if s.span != span or s.start < at or exact or s.start + s.tokens > m.spans[span].tokens:
            raise WireError(f"{where}: sample {i} (span {s.span}, tokens {s.start}:{s.start + s.tokens}) does not "
                            f"continue span {span} at token {at}")
        at = s.start + s.tokens
    if m.spans and (span != len(m.spans) - 1 or (m.v < 2 and at != m.spans[-1].tokens)):
        raise WireError(f"{where}: its samples cover spans up to {span} token {at}, not all {len(m.spans)} spans")


def pool_ref(worker: str, pool: PoolInfo) -> PoolRef:
    """How a manifest names ``worker``'s pool, as the worker announced it."""
    return PoolRef(worker=worker, id=pool.id, size=pool.size, host=pool.host, path=pool.path, address=pool.address,
                   public_key=pool.public_key)


# a rollout's header -> which of its samples the step keeps, and the lowest version its loss mask keeps (None: any)
SamplePlan = Callable[["RolloutHeader"], tuple[list[bool], int | None]]


def build_manifest(run: str, step: int, trained: Sequence[tuple[RolloutRecord, float]],
                   pools: Mapping[str, PoolInfo], attempt: int = 0, logprobs_mode: LogprobsMode | None = None,
                   temperatures: Mapping[str, float] | None = None, plan: SamplePlan | None = None) -> StepManifest:
    """The manifest of a step from its trained records (with their advantages) and each worker's current pool
    (by worker name). WireError for a record whose span is not in its worker's current pool: its columns are
    gone (the worker restarted or renewed its pool), so that rollout cannot train. ``temperatures``: each env's
    sampling temperature, a per-sample scalar (the trainer recomputes processed logprobs at it). ``plan``: which
    samples each rollout keeps and its ``min_version`` (scoring/token_lag.py; default: every sample, no floor)."""
    refs: dict[str, int] = {}
    pool_refs: list[PoolRef] = []
    spans: list[SpanRef] = []
    samples: list[SampleRef] = []
    scalars: dict[str, list[Scalar]] = {"advantage": [], "reward": [], "env": [], "rollout": [], "policy": [],
                                        "policy_max": [], "min_version": []}
    for rec, advantage in trained:
        h = rec.header
        pool = pools.get(h.worker)
        if h.span is None or not h.samples or pool is None or pool.id != h.span.pool:
            raise WireError(f"rollout {h.rid}: its columns are not in env worker {h.worker}'s current pool")
        if h.worker not in refs:
            refs[h.worker] = len(pool_refs)
            pool_refs.append(pool_ref(h.worker, pool))
        layers, top_k = h.samples[0][1:]
        spans.append(SpanRef(refs[h.worker], h.span.offset, h.tokens, layers, top_k, h.routed_dtype, h.rid,
                             list(h.optional)))
        keep, floor = plan(h) if plan is not None else ([True] * len(h.samples), None)
        start = 0
        for (tokens, _, _), kept in zip(h.samples, keep, strict=True):
            start += tokens
            if not kept:
                continue
            samples.append(SampleRef(len(spans) - 1, start - tokens, tokens))
            scalars["advantage"].append(advantage)
            scalars["reward"].append(rec.reward)
            scalars["env"].append(h.env)
            scalars["rollout"].append(h.rid)
            scalars["policy"].append(h.policy_step)
            scalars["policy_max"].append(h.policy_step if h.policy_max is None else h.policy_max)
            scalars["min_version"].append(floor)
    if temperatures is not None:
        scalars["temperature"] = [temperatures.get(str(env), 1.0) for env in scalars["env"]]
    return StepManifest(run=run, step=step, attempt=attempt, pools=pool_refs, spans=spans, samples=samples,
                        columns=expected_columns(spans), scalars=scalars, logprobs_mode=logprobs_mode)
