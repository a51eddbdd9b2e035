"""Messages between the orchestrator (ZMQ ROUTER) and env workers (ZMQ DEALER), as typed structs.

Every message is a multipart ZMQ message whose first frame is a msgpack map with a ``type`` tag, decoded
once, at the edge, into one of the structs below (msgspec checks every field's type and bound); anything
else is a ``WireError``. Column frames follow a ``records`` message.

worker -> orchestrator (``WorkerMessage``)
  ``hello``      Hello       on connect; answered with ``setup``
  ``ready``      Ready       environments loaded (tasks per env); assignments may start
  ``records``    Records     finished rollouts of one group + their column frames, in order: sent together
                             when the group ends (or FLUSH_S after the last one finished while others still
                             run), so the orchestrator handles one message per group
  ``heartbeat``  Heartbeat   every HEARTBEAT_S
  ``fatal``      Fatal       the worker cannot go on (an env failed to load)

orchestrator -> worker (``OrchestratorMessage``)
  ``setup``      Setup       environments to load, model, tokenizer
  ``assign``     Assign      run len(rids) rollouts of one task on one inference server
  ``cancel``     Cancel      drop a group (stale or timed out)
  ``release``    Release     direct data plane: these rollouts' spans of the worker's column pool are free
                             (with ``keep``: every span but those is free)
  ``stop``       Stop        exit cleanly

A rollout is a ``RolloutHeader`` (scalars, per sample ``[tokens, layers, top_k]``, and the optional token columns
it has: ``optional``), followed, when it has samples, by one frame per column of ``column_names(optional)``
(columns/layout.py: token ids (int32), loss mask (uint8), logprobs (float32), the optional ones it has (``versions``,
int32), then routed experts (``routed_dtype``: uint8, or uint16 for models with more than 256 experts; possibly
empty)), each the concatenation of all its samples. Frames are sent and received without copies. On the direct
data plane (docs/data-plane.md) no frames follow: the header's ``span`` says where the worker wrote the same bytes
in its own column pool (``Ready.pool``), in the layout of columns/layout.py.

A failed rollout carries a ``Failure`` kind (one small vocabulary, shared by worker, hub, scheduler, pool and
metrics) and a message; ``RolloutHeader.failed`` is the one way to make one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from orchestrator.columns.layout import (
    ALIGN,
    MAX_POOL_BYTES,
    ROUTED,
    TOKEN_DTYPES,
    PoolId,
    SpanLoc,
    column_names,
    shapes_layout,
)
from orchestrator.columns.samples import Sample
from orchestrator.columns.store import sample_optional, sample_shapes
from orchestrator.errors import Failure, WireError

HEARTBEAT_S = 1.0
FLUSH_S = 1.0

Count = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]


class RolloutHeader(msgspec.Struct, kw_only=True):
    """The scalars of one finished rollout (its columns travel as frames after the ``records`` header)."""

    rid: Name
    group: Name
    env: Name
    task: Count
    policy_step: Count
    worker: str
    server: str
    ok: bool
    policy_max: Count | None = None  # the orchestrator's, on arrival: the newest weights its server could have had
    reward: float | None = None  # None: a failed rollout with no usable reward
    metrics: dict[str, float] = {}
    failure: Failure | None = None
    error: str | None = None  # what failed, for people (the first error of the rollout)
    stop: str | None = None  # verifiers' stop condition
    is_timeout: bool = False
    samples: list[tuple[Count, Count, Count]] = []  # per sample: tokens, layers, top_k
    routed_dtype: Literal["uint8", "uint16"] = "uint8"  # of the routed-experts frame
    optional: Annotated[list[Name], msgspec.Meta(max_length=8)] = []  # the optional token columns it has
    # per sample, its trained tokens by their versions value ((value, count), columns/versions.py): what the
    # orchestrator masks stale tokens with (max_token_lag) without reading columns; empty without a versions column
    versions: list[Annotated[list[tuple[int, Count]], msgspec.Meta(max_length=1 << 16)]] = []
    tokens: Count = 0
    turns: Count = 0  # model turns (verifiers' trace.num_turns)
    wall_s: float = 0.0
    frames: Count = 0  # column frames that follow this header in its message: 0 or len(column_names(optional))
    span: SpanLoc | None = None  # direct data plane: where its columns are in the worker's pool (frames 0)
    filters: list[Count] = []  # direct data plane: Setup.token_filters it matched (their indices)

    @classmethod
    def failed(cls, base: RolloutHeader | AssignedRollout, failure: Failure, error: str, *, wall_s: float = 0.0,
               stop: str | None = None, is_timeout: bool = False) -> RolloutHeader:
        """The header of a rollout that failed with ``failure``; ``error`` says what happened, for people."""
        return cls(rid=base.rid, group=base.group, env=base.env, task=base.task, policy_step=base.policy_step,
                   worker=base.worker, server=base.server, ok=False, failure=failure, error=error, wall_s=wall_s,
                   stop=stop, is_timeout=is_timeout)


@dataclass(frozen=True)
class AssignedRollout:
    """Who ran a rollout, before it has a result (the fields ``RolloutHeader.failed`` copies)."""

    rid: str
    group: str
    env: str
    task: int
    policy_step: int
    worker: str
    server: str


# ----------------------------------------------------------------------------------- worker -> orchestrator


class Hello(msgspec.Struct, tag="hello", tag_field="type"):
    worker: Name
    pid: int | None = None


class PoolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's column pool (the direct data plane): which one, how large, where a trainer on ``host`` gets its
    fd (a Unix socket: memfd.serve_pool), and where a trainer on another host fetches its spans (``address``:
    a span server, trainer/fetch.py; none unless the worker was given one)."""

    id: PoolId
    size: Annotated[int, msgspec.Meta(ge=ALIGN, le=MAX_POOL_BYTES)]
    host: Name
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=107)] | None = None
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None  # its span server, if any
    public_key: Annotated[str, msgspec.Meta(min_length=40, max_length=40)] | None = None  # the server's CURVE key


class Ready(msgspec.Struct, tag="ready", tag_field="type"):
    worker: Name
    envs: dict[str, Count]  # env name -> tasks
    pool: PoolInfo | None = None  # direct data plane: the pool its records' spans are in


class Records(msgspec.Struct, tag="records", tag_field="type"):
    group: Name
    records: list[RolloutHeader]


class Heartbeat(msgspec.Struct, tag="heartbeat", tag_field="type"):
    worker: Name
    inflight: Count = 0
    rss_mb: float | None = None
    pool_free: Count | None = None  # direct data plane: the largest free range of its column pool, in bytes


class Fatal(msgspec.Struct, tag="fatal", tag_field="type"):
    worker: Name
    error: str


WorkerMessage = Hello | Ready | Records | Heartbeat | Fatal

# ----------------------------------------------------------------------------------- orchestrator -> worker


class EnvSpec(msgspec.Struct):
    """One ``[[env]]`` table as a worker loads it (see envconfig.py for ``verifiers`` and ``select``)."""

    name: str
    taskset: str
    args: dict[str, Any] = {}
    verifiers: dict[str, Any] = {}
    select: dict[str, Any] = {}
    key: str = "env"  # its key path in the job config (env[1]), so load errors name it


TokenFilterName = Literal["gibberish", "repetition"]  # scoring/filters.py TOKEN_FILTERS


class TokenFilter(msgspec.Struct, frozen=True):
    """A token filter the worker runs on each rollout's sampled tokens (the direct data plane): ``index`` in
    ``[[pipeline.filters]]``, its built-in ``name`` and its arguments (scoring/filters.py)."""

    index: Count
    name: TokenFilterName
    args: dict[str, Any] = {}


class Setup(msgspec.Struct, tag="setup", tag_field="type"):
    envs: list[EnvSpec]
    model: str
    tokenizer: str
    request_timeout_s: float | None = None  # of each generate call (read timeout: a pause holds a call open)
    api_key_env: str | None = None  # environment variable holding the servers' API key
    data_plane: Literal["through", "direct"] = "through"  # direct: columns go to the worker's own pool
    worker_pool_bytes: Count = 0  # direct data plane: the pool's size (transport.worker_pool_mb)
    pool_dir: str | None = None  # direct data plane: where the pool's socket goes (<pool_dir>/<worker>.pool)
    session: str = ""  # the orchestrator process: a worker set up again by another one renews its pool
    token_filters: list[TokenFilter] = []  # direct data plane: filters the worker runs (header.filters)
    span_clients: list[str] = []  # direct: the trainers' public keys (Z85) a worker's span server accepts (CURVE)

    def same_job(self, other: Setup) -> bool:
        """Whether ``other`` loads the same environments the same way (only ``session`` may differ)."""
        return msgspec.structs.replace(other, session=self.session) == self


class Assign(msgspec.Struct, tag="assign", tag_field="type"):
    group: str
    env: str
    task: Count
    rids: list[str]
    server: str
    sampling: dict[str, Any]
    policy_step: Count
    train: bool = True  # False: an evaluation group, whose rollouts build no training samples


class Cancel(msgspec.Struct, tag="cancel", tag_field="type"):
    group: str


class Release(msgspec.Struct, tag="release", tag_field="type"):
    """Free the spans of ``rids``; with ``keep`` (a resync when the worker is re-admitted), also every span
    whose rollout is not in ``keep``: the orchestrator holds exactly those."""

    rids: list[str]
    keep: list[str] | None = None


class Stop(msgspec.Struct, tag="stop", tag_field="type"):
    pass


OrchestratorMessage = Setup | Assign | Cancel | Release | Stop

_encoder = msgspec.msgpack.Encoder()
_worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
_orchestrator_decoder = msgspec.msgpack.Decoder(OrchestratorMessage)


def pack(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_worker_message(frame: bytes | memoryview) -> WorkerMessage:
    """A worker's message header, validated; WireError naming what is wrong otherwise."""
    try:
        msg: WorkerMessage = _worker_decoder.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # ValidationError included; msgspec 0.22 raises
        raise WireError(f"invalid worker message: {e}") from None  # UnicodeDecodeError for a string not in UTF-8
    return msg


def decode_orchestrator_message(frame: bytes | memoryview) -> OrchestratorMessage:
    try:
        msg: OrchestratorMessage = _orchestrator_decoder.decode(frame)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise WireError(f"invalid orchestrator message: {e}") from None
    return msg


def header_from_dict(raw: Any) -> RolloutHeader:
    """A header stored as plain data (a step dump); WireError if it is not one."""
    try:
        return msgspec.convert(raw, RolloutHeader)
    except msgspec.ValidationError as e:
        raise WireError(f"invalid rollout header: {e}") from None


def header_to_dict(header: RolloutHeader) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(header)
    return out


# -------------------------------------------------------------------------------------------- records


def sample_frames(samples: list[Sample]) -> tuple[list[tuple[int, int, int]], list[bytes | np.ndarray]]:
    """Per-sample shapes ``(tokens, layers, top_k)`` and the column frames of ``column_names(optional)`` (one
    concatenation each; ``optional``: ``sample_optional(samples)``, the header's); the routed-experts frame, last,
    is uint8 unless some sample's ids need uint16 (``frames[-1].dtype`` says)."""
    shapes, _ = sample_shapes(samples)
    if not samples:
        return shapes, []
    frames: list[bytes | np.ndarray] = []
    for name in column_names(sample_optional(samples))[:-1]:
        frames.append(np.concatenate([s.column(name) for s in samples]))
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    frames.append(np.concatenate([r.reshape(-1) for r in routed]) if routed else b"")
    return shapes, frames


def records_message(group: str, records: list[tuple[RolloutHeader, list[Any]]]) -> list[Any]:
    """One ``records`` message: the headers (each saying how many frames follow it) then all frames."""
    for header, frames in records:
        header.frames = len(frames)
    return [pack(Records(group, [h for h, _ in records])), *(x for _, f in records for x in f)]


def split_records(msg: Records, frames: list[memoryview]) -> list[RolloutRecord]:
    """The rollout records of a ``records`` message; WireError when the frames do not add up."""
    counts = [h.frames for h in msg.records]
    if any(h.frames not in (0, len(_names(h))) for h in msg.records) or sum(counts) != len(frames):
        raise WireError(f"records message: frame counts {counts} do not match its {len(frames)} frames")
    out, i = [], 0
    for h, n in zip(msg.records, counts, strict=True):
        out.append(RolloutRecord(h, frames[i:i + n]))
        i += n
    return out


def _names(h: RolloutHeader) -> tuple[str, ...]:
    """The columns of ``h``'s rollout (WireError for an optional column this version does not know)."""
    try:
        return column_names(h.optional)
    except ValueError as e:
        raise WireError(f"rollout {h.rid}: {e}") from None


@dataclass
class RolloutRecord:
    """A finished rollout as the orchestrator holds it: scalars plus column frames it never copies."""

    header: RolloutHeader
    frames: list[memoryview]  # one per column of column_names(header.optional) (none when no samples)

    @property
    def rid(self) -> str:
        return self.header.rid

    @property
    def env(self) -> str:
        return self.header.env

    @property
    def reward(self) -> float:
        return self.header.reward or 0.0  # None: a failed rollout with no usable reward

    @property
    def ok(self) -> bool:
        return self.header.ok

    @property
    def tokens(self) -> int:
        return self.header.tokens

    @property
    def worker_filters(self) -> list[int]:
        """Indices of the token filters its worker found it matched (the direct data plane)."""
        return self.header.filters

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns it carries, in frame order (columns/layout.py ``column_names``)."""
        return column_names(self.header.optional)

    def dtype(self, name: str) -> np.dtype[Any]:
        return np.dtype(self.header.routed_dtype) if name == ROUTED else TOKEN_DTYPES[name]

    def column(self, name: str) -> np.ndarray:
        """A column of all this rollout's samples, concatenated (a view of the received frame). WireError for a
        record whose columns stayed in its worker's pool (the direct data plane): the orchestrator never reads
        them; KeyError for an optional column it does not have."""
        if self.header.span is not None:
            raise WireError(f"rollout {self.rid}: its columns are in env worker {self.header.worker}'s pool "
                            "(the direct data plane), not in this process")
        names = self.columns
        if name not in names:
            raise KeyError(f"rollout {self.rid} has no column {name!r} (it has {', '.join(names)})")
        if not self.frames:
            return np.zeros(0, self.dtype(name))
        return np.frombuffer(self.frames[names.index(name)], dtype=self.dtype(name))

    def sampled(self) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, logprobs) of the sampled tokens, for filters."""
        mask = self.column("loss_mask").astype(bool)
        return self.column("token_ids")[mask], self.column("logprobs")[mask]

    def check(self) -> None:
        """Raise WireError when the frames do not match the header's shapes, or a failed rollout has data."""
        h = self.header
        if not h.ok:
            if h.failure is None or h.samples or self.frames or h.span is not None:
                raise WireError(f"rollout {h.rid}: a failed rollout must name its failure and carry no samples")
            return
        if h.failure is not None or h.reward is None or not math.isfinite(h.reward):
            raise WireError(f"rollout {h.rid}: a successful rollout with failure {h.failure} / reward {h.reward}")
        if not h.samples:
            if self.frames or h.span is not None:
                raise WireError(f"rollout {h.rid}: columns and no samples")
            return
        names = _names(h)
        if h.span is not None:
            self._check_span(h, h.span)
            return
        if len(self.frames) != len(names):
            raise WireError(f"rollout {h.rid}: {len(self.frames)} column frames, expected {len(names)} "
                            f"({', '.join(names)})")
        tokens = sum(s[0] for s in h.samples)
        if tokens != h.tokens:
            raise WireError(f"rollout {h.rid}: header says {h.tokens} tokens, its samples {tokens}")
        tails = {(s[1], s[2]) for s in h.samples}
        if len(tails) > 1:
            raise WireError(f"rollout {h.rid}: routed-expert shapes differ across its samples: {sorted(tails)}")
        routed = sum(s[0] * s[1] * s[2] for s in h.samples)
        for name, frame in zip(names, self.frames, strict=True):
            expect = routed if name == ROUTED else tokens
            if len(frame) != expect * self.dtype(name).itemsize:
                raise WireError(f"rollout {h.rid}: column {name} has {len(frame)} bytes for {expect} values")

    def _check_span(self, h: RolloutHeader, span: SpanLoc) -> None:
        """A direct-mode record: no frames, and a span exactly as large as its samples' layout. (Whether the
        span lies in the worker's current pool is the hub's check: it knows the pool.)"""
        if self.frames:
            raise WireError(f"rollout {h.rid}: {len(self.frames)} column frames and a span in the worker's pool")
        tokens = sum(s[0] for s in h.samples)
        if tokens != h.tokens:
            raise WireError(f"rollout {h.rid}: header says {h.tokens} tokens, its samples {tokens}")
        try:
            layout = shapes_layout(h.samples, h.routed_dtype, h.optional)
        except ValueError as e:
            raise WireError(f"rollout {h.rid}: {e}") from None
        if span.offset % ALIGN or span.nbytes != layout.nbytes:
            raise WireError(f"rollout {h.rid}: span of {span.nbytes} bytes at {span.offset}; its samples take "
                            f"{layout.nbytes} bytes at a multiple of {ALIGN}")


def check_span(h: RolloutHeader, pool: PoolInfo | None) -> None:
    """WireError unless a record's span (if any) lies in ``pool``, the one its worker announced last (the
    hub's check, after ``RolloutRecord.check``)."""
    span = h.span
    if span is None:
        return
    if pool is None or span.pool != pool.id:
        raise WireError(f"rollout {h.rid}: its span is in pool {span.pool}, the worker's pool is "
                        f"{pool.id if pool else 'none'}")
    if span.offset + span.nbytes > pool.size:
        raise WireError(f"rollout {h.rid}: span {span.offset}..{span.offset + span.nbytes} lies outside the "
                        f"{pool.size}-byte pool {pool.id}")
