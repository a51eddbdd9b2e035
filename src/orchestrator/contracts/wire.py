"""Wire format v1: one step's batch as a ZMQ multipart message (see docs/wire-format.md).

Frame 0 is a small msgpack header; each following frame is one column's raw bytes, all samples
concatenated. ``Batch`` holds the columns and per-sample offsets; ``encode`` makes the frames without
copying column bytes; ``decode`` wraps received frames with ``np.frombuffer`` (zero copies) after
checking every size against the header. The shared-memory variant (``encode_shm_header``) is the header
alone, naming where each column lies in the sender's pool; ``decode`` then views the receiver's mapping
of that pool. Importable without verifiers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import msgpack
import numpy as np

from orchestrator.columns.layout import TOKEN_DTYPES
from orchestrator.errors import WireError

FORMAT_VERSION = 1
SHM_ALIGN = 64  # every column in a shared-memory pool starts at a multiple of this
# which logprobs the ``logprobs`` column holds: vLLM's raw_logprobs (log-softmax of the unscaled logits) or
# processed_logprobs (of the distribution the token was sampled from: temperature, top-k, top-p applied)
LogprobsMode = Literal["raw", "processed"]
LOGPROBS_MODES: tuple[LogprobsMode, ...] = get_args(LogprobsMode)

# pool id, pool size -> the receiver's read-only mapping of that pool (raises WireError if it cannot map it)
ShmResolver = Callable[[str, int], memoryview]


@dataclass
class Batch:
    """One step's samples, columnar. ``offsets[i]:offsets[i+1]`` are sample i's tokens in every column."""

    run: str
    step: int
    columns: dict[str, np.ndarray]  # token columns [T] (columns/layout.py) and maybe routed_experts [T, layers, top_k]
    offsets: np.ndarray  # int64 [n + 1]
    scalars: dict[str, list[Any]]  # per-sample: advantage, reward, env, ... (n each)
    shm_pool: str | None = None  # set by a receiver: the columns view this shared-memory pool (see release)
    # which logprobs the logprobs column holds (see LogprobsMode), as the orchestrator settled it with the
    # servers; None: the sender did not say (an older one, or a run without preflight and logprobs_mode "auto")
    logprobs_mode: LogprobsMode | None = None

    @property
    def num_samples(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def sample(self, i: int) -> dict[str, Any]:
        """Sample ``i``: its columns as views (no copies) and its scalars."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        out: dict[str, Any] = {name: col[a:b] for name, col in self.columns.items()}
        out.update({k: v[i] for k, v in self.scalars.items()})
        return out

    @classmethod
    def from_columns(cls, run: str, step: int, chunks: Mapping[str, Sequence[np.ndarray]], lengths: Sequence[int],
                     scalars: dict[str, list[Any]], logprobs_mode: LogprobsMode | None = None) -> Batch:
        """Assemble from per-sample (or per-rollout) column chunks: one concatenation per column."""
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        columns = {name: _concatenate(parts, TOKEN_DTYPES.get(name, np.dtype("u1"))) for name, parts in chunks.items()}
        for name, col in columns.items():
            if col.shape[0] != offsets[-1]:
                raise WireError(f"column {name} has {col.shape[0]} rows for {offsets[-1]} tokens")
        for k, v in scalars.items():
            if len(v) != len(lengths):
                raise WireError(f"scalar {k} has {len(v)} values for {len(lengths)} samples")
        return cls(run, step, columns, offsets, scalars, logprobs_mode=logprobs_mode)


def _concatenate(parts: Sequence[np.ndarray], empty_dtype: np.dtype[Any]) -> np.ndarray:
    """``np.concatenate`` by slice assignment into one preallocated array: 3-5x faster on large uint8 parts
    (bench_step's routed experts: 256 x 1.5 MB), and each copy is a short call between GIL switch points."""
    if not parts:
        return np.zeros(0, empty_dtype)
    first = parts[0]
    out = np.empty((sum(len(p) for p in parts), *first.shape[1:]), np.result_type(*parts))
    i = 0
    for p in parts:
        out[i:i + len(p)] = p  # raises on a part whose trailing shape differs, as np.concatenate does
        i += len(p)
    return out


def encode(batch: Batch) -> list[Any]:
    """Frames of ``batch``: the header, then each column's bytes (memoryviews of the arrays, no copies)."""
    cols = []
    frames: list[Any] = []
    for name, arr in batch.columns.items():
        arr = np.ascontiguousarray(arr)
        cols.append({"name": name, "dtype": arr.dtype.str, "tail": list(arr.shape[1:]), "frame": len(frames) + 1})
        frames.append(arr.reshape(-1).view(np.uint8).data)  # a bytes view; works for empty shapes too
    return [msgpack.packb(_header(batch, cols), use_bin_type=True), *frames]


def shm_layout(columns: Mapping[str, np.ndarray]) -> tuple[dict[str, tuple[int, int]], int]:
    """Where each (C-contiguous) column goes in one span: name -> (offset in the span, bytes), and the span's
    size; every offset and the size are multiples of SHM_ALIGN (the size at least SHM_ALIGN)."""
    layout: dict[str, tuple[int, int]] = {}
    at = 0
    for name, arr in columns.items():
        layout[name] = (at, arr.nbytes)
        at += -(-arr.nbytes // SHM_ALIGN) * SHM_ALIGN
    return layout, max(at, SHM_ALIGN)


def encode_shm_header(batch: Batch, columns: Mapping[str, np.ndarray], at: Mapping[str, tuple[int, int]],
                      pool_id: str, pool_size: int) -> bytes:
    """The one frame of a shared-memory batch: the v1 header whose columns name ``shm_offset`` (absolute, in
    the pool) and ``nbytes`` instead of a frame, plus ``shm``: the pool's id and size."""
    cols = [{"name": name, "dtype": arr.dtype.str, "tail": list(arr.shape[1:]), "shm_offset": at[name][0],
             "nbytes": at[name][1]} for name, arr in columns.items()]
    return msgpack.packb({**_header(batch, cols), "shm": {"id": pool_id, "size": pool_size}}, use_bin_type=True)


def _header(batch: Batch, cols: list[dict[str, Any]]) -> dict[str, Any]:
    h = {"v": FORMAT_VERSION, "run": batch.run, "step": batch.step, "n": batch.num_samples,
         "offsets": batch.offsets.tolist(), "scalars": batch.scalars, "columns": cols}
    if batch.logprobs_mode is not None:  # absent when unknown: a receiver reads None, as from an older sender
        h["logprobs_mode"] = batch.logprobs_mode
    return h


def decode(frames: Sequence[Any], shm: ShmResolver | None = None) -> Batch:
    """A Batch viewing ``frames`` (bytes, memoryviews or zmq Frames) without copying; WireError if invalid.
    A shared-memory header's columns view the mapping ``shm`` returns for the pool it names (no copies
    either); without ``shm`` such a header is a WireError."""
    if not frames:
        raise WireError("empty message: no header frame")
    try:
        h = msgpack.unpackb(_buffer(frames[0]), raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"header is not msgpack: {e}") from None
    if not isinstance(h, dict):
        raise WireError(f"header is a {type(h).__name__}, not a map")
    if h.get("v") != FORMAT_VERSION:
        raise WireError(f"format version {h.get('v')!r}, this receiver reads {FORMAT_VERSION}")
    try:
        n, step = h["n"], h["step"]
        if not (isinstance(n, int) and isinstance(step, int)) or n < 0 or step < 0:
            raise ValueError(f"n and step must be integers >= 0, got {n!r} and {step!r}")
        offsets = np.asarray(h["offsets"], dtype=np.int64)
        run, cols, scalars = str(h["run"]), list(h["columns"]), dict(h["scalars"])
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise WireError(f"header misses or mangles a field: {e!r}") from None
    if offsets.shape != (n + 1,) or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise WireError(f"offsets do not describe {n} samples")
    mode = h.get("logprobs_mode")
    if mode is not None and mode not in LOGPROBS_MODES:
        raise WireError(f"header field logprobs_mode is {mode!r}, not one of {', '.join(LOGPROBS_MODES)}")
    region = _shm_region(h, shm) if "shm" in h else None
    if region is None and len(frames) != len(cols) + 1:
        raise WireError(f"{len(frames) - 1} column frames, header lists {len(cols)}")
    if region is not None and len(frames) != 1:
        raise WireError(f"a shared-memory batch is one frame, got {len(frames)}")
    tokens = int(offsets[-1])
    columns: dict[str, np.ndarray] = {}
    for c in cols:
        try:
            name, dtype, tail = str(c["name"]), np.dtype(c["dtype"]), tuple(int(x) for x in c["tail"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise WireError(f"bad column entry {c!r}: {e}") from None
        if dtype.kind not in "biuf" or dtype.itemsize == 0 or any(x < 0 for x in tail):
            raise WireError(f"column {name}: dtype {dtype.str} / tail {list(tail)} is not a numeric column")
        buf = _frame_buffer(c, name, frames) if region is None else _shm_buffer(c, name, region)
        need = tokens * int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
        if len(buf) != need:
            raise WireError(f"column {name}: frame has {len(buf)} bytes, header implies {need}")
        try:  # a tail whose product overflows passes the size check above with zero tokens
            columns[name] = np.frombuffer(buf, dtype=dtype).reshape(tokens, *tail)
        except ValueError as e:
            raise WireError(f"column {name}: tail {list(tail)} does not fit its {len(buf)} bytes: {e}") from None
    for k, v in scalars.items():
        if not isinstance(v, list) or len(v) != n:
            raise WireError(f"scalar {k!r} does not have {n} values")
    return Batch(run, step, columns, offsets, scalars, shm_pool=None if region is None else str(h["shm"]["id"]),
                 logprobs_mode=mode)


def _frame_buffer(c: Mapping[str, Any], name: str, frames: Sequence[Any]) -> memoryview:
    idx = c.get("frame")
    if not isinstance(idx, int) or not 1 <= idx < len(frames):
        raise WireError(f"column {name}: frame index {idx!r} out of range")
    return _buffer(frames[idx])


def _shm_region(h: Mapping[str, Any], shm: ShmResolver | None) -> memoryview:
    pool = h["shm"]
    if not (isinstance(pool, dict) and isinstance(pool.get("id"), str) and isinstance(pool.get("size"), int)):
        raise WireError(f"header field shm must be a map with a str id and an int size, got {pool!r}")
    if shm is None:
        raise WireError(f"a shared-memory batch (pool {pool['id']}), and this receiver maps no pool")
    return shm(pool["id"], pool["size"])


def _shm_buffer(c: Mapping[str, Any], name: str, region: memoryview) -> memoryview:
    at, nbytes = c.get("shm_offset"), c.get("nbytes")
    if not (isinstance(at, int) and isinstance(nbytes, int)) or at < 0 or nbytes < 0 or at % SHM_ALIGN:
        raise WireError(f"column {name}: shm_offset {at!r} / nbytes {nbytes!r} are not a {SHM_ALIGN}-aligned span")
    if at + nbytes > len(region):
        raise WireError(f"column {name}: bytes {at}..{at + nbytes} lie outside the {len(region)}-byte pool")
    return region[at:at + nbytes]


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", frame)
    return buf if isinstance(buf, memoryview) else memoryview(buf)
