"""prime-rl compatible batches: a step's ``Batch`` as the msgpack bytes of prime-rl's ``TrainingBatch``.

prime-rl's trainer (``ZMQTrainingBatchReceiver``) pulls two-frame messages ``[sender_id, payload]``, where
``payload`` is a msgspec-msgpack ``TrainingBatch``. Its structs are ``array_like``, so every struct is a
msgpack array of all its fields in declaration order (msgspec writes ``nil`` for unset optional fields;
``omit_defaults`` does not shorten array-like structs). ``encode_primerl`` writes the same bytes without
msgspec: each per-token column is msgpack-encoded for the whole batch at once with numpy (no per-token
Python objects; ~3x faster than packing Python lists), the small parts with ``msgpack``. It is still
O(tokens) CPU work and one copy of the payload (~90 ms per million tokens on a shared 2-core machine), so
call it in a worker thread, not on the event loop. ``decode_primerl`` reads a payload back, for tests and
for users.

The layout is taken from prime-rl at ``PRIMERL_COMMIT`` (``src/prime_rl/transport/types.py``,
``zmq.py``), the last commit before prime-rl moved packing into its orchestrator and removed
``TrainingBatch`` (#3189). docs/wire-format.md, "prime-rl format", lists the fields.

Mapping from our batch: ``token_ids`` -> ``token_ids``; ``loss_mask`` -> ``mask`` (bools); ``logprobs`` ->
``logprobs``; the sampling temperature repeated per token -> ``temperatures``; scalar ``env`` ->
``env_name``; scalar ``advantage`` broadcast over the sample's trainable tokens (0.0 elsewhere) ->
``advantages``, as prime-rl's own orchestrator does; ``routed_experts`` -> ``[bytes, shape, dtype]``.
Scalars prime-rl has no field for (``reward``, ``rollout``, ...) are not sent. Importable without verifiers.
"""

from __future__ import annotations

import contextlib
import logging
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from orchestrator.errors import TransportError, WireError
from orchestrator.transport.checkpoints import Checkpoint, marker_announcements
from orchestrator.transport.wire import Batch
from orchestrator.transport.zmq_link import push_polling

log = logging.getLogger(__name__)

PRIMERL_COMMIT = "3ab5e04c4cb412ee5c19e49b9afc9f89261dce3d"
SAMPLE_FIELDS = ("token_ids", "mask", "logprobs", "temperatures", "env_name", "ref_logprobs", "mm_kwargs",
                 "routed_experts", "mm_token_type_ids", "rl_weights", "ce_weights", "ref_kl_weights",
                 "advantages")
REQUIRED_SAMPLE_FIELDS = 5  # token_ids .. env_name have no default
BATCH_FIELDS = ("examples", "step", "run_idx")
ROUTED_FIELDS = ("data", "shape", "dtype")
_PER_TOKEN = {"token_ids": "int64", "mask": "bool", "logprobs": "float64", "temperatures": "float64",
              "ref_logprobs": "float64", "mm_token_type_ids": "int64", "rl_weights": "float64",
              "ce_weights": "float64", "ref_kl_weights": "float64", "advantages": "float64"}


def encode_primerl(batch: Batch, sender_id: bytes, *, temperature: float | Mapping[str, float] = 1.0) -> list[bytes]:
    """The two frames ``[sender_id, payload]`` prime-rl's trainer reads for ``batch``.

    ``sender_id`` is how prime-rl's receiver tells orchestrators apart: the name of the run directory
    (prime-rl uses ``output_dir.stem``). The temperature of sample ``i`` is ``batch.scalars["temperature"][i]``
    if the batch has that scalar, else ``temperature`` (one value, or one per env name).
    """
    if not isinstance(sender_id, bytes):
        raise TypeError(f"sender_id must be bytes, got {type(sender_id).__name__}")
    for name in ("token_ids", "loss_mask", "logprobs"):
        if name not in batch.columns:
            raise WireError(f"prime-rl format needs column {name!r}; the batch has {sorted(batch.columns)}")
    if "env" not in batch.scalars:
        raise WireError(f"prime-rl format needs the per-sample scalar 'env'; the batch has {sorted(batch.scalars)}")
    cols = batch.columns
    mask = np.asarray(cols["loss_mask"]).astype(bool)
    lengths = np.diff(batch.offsets)
    advantages = batch.scalars.get("advantage", [None] * batch.num_samples)
    per_token_adv = np.repeat(np.array([0.0 if a is None else float(a) for a in advantages]), lengths)
    tokens, tok_at = _ints(np.asarray(cols["token_ids"]))
    flags = np.where(mask, 0xC3, 0xC2).astype(np.uint8)  # msgpack true / false
    logprobs = _floats(np.asarray(cols["logprobs"]))
    adv = _floats(np.where(mask, per_token_adv, 0.0))
    routed = cols.get("routed_experts")
    temperatures = _temperatures(batch, temperature)
    packer = msgpack.Packer(use_bin_type=True)
    parts: list[Any] = [packer.pack_array_header(len(BATCH_FIELDS)), packer.pack_array_header(batch.num_samples)]
    for i in range(batch.num_samples):
        a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
        head = packer.pack_array_header(b - a)
        parts += [packer.pack_array_header(len(SAMPLE_FIELDS)),
                  head, tokens[tok_at[a]:tok_at[b]],  # token_ids
                  head, flags[a:b],  # mask
                  head, logprobs[9 * a:9 * b],  # logprobs
                  head, (b"\xcb" + struct.pack(">d", temperatures[i])) * (b - a),  # temperatures
                  packer.pack(str(batch.scalars["env"][i])),  # env_name
                  _NIL * 2]  # ref_logprobs, mm_kwargs
        parts += _routed(packer, routed[a:b]) if routed is not None else [_NIL]
        parts.append(_NIL * 4)  # mm_token_type_ids, rl_weights, ce_weights, ref_kl_weights
        parts += [_NIL] if advantages[i] is None else [head, adv[9 * a:9 * b]]  # advantages
    parts += [packer.pack(batch.step), _NIL]  # step; run_idx is set by prime-rl's receiver
    return [sender_id, b"".join(parts)]


_NIL = b"\xc0"


def _floats(values: np.ndarray) -> np.ndarray:
    """msgpack float64 encoding of every value, concatenated: 9 bytes each (0xcb, big-endian double)."""
    out = np.empty((values.size, 9), dtype=np.uint8)
    out[:, 0] = 0xCB
    out[:, 1:] = values.astype(">f8").view(np.uint8).reshape(-1, 8)
    return out.reshape(-1)


def _ints(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """msgpack encoding of every int in its smallest form (as msgpack and msgspec write them), concatenated,
    and the byte offset of each value (``size + 1`` entries). Covers the int32 and uint32 ranges."""
    v = values.astype(np.int64).reshape(-1)
    if v.size and (v.min() < -(1 << 31) or v.max() >= 1 << 32):
        raise WireError(f"token id out of the int32/uint32 range: {v.min()}..{v.max()}")
    # kinds 0-3: fixint, uint8, uint16, uint32 (v >= 0); 4-7: int32, int16, int8, negative fixint
    kind = np.where(v >= 0, np.searchsorted(_POS_LIMITS, v, side="right"),
                    4 + np.searchsorted(_NEG_LIMITS, v, side="right"))
    payload = _PAYLOAD[kind]  # bytes after the type byte
    matrix = np.empty((v.size, 5), dtype=np.uint8)
    matrix[:, 0] = np.where(payload == 0, v & 0xFF, _TYPE_BYTE[kind])
    matrix[:, 1:] = (v & 0xFFFFFFFF).astype(">u4").view(np.uint8).reshape(-1, 4)
    keep = np.arange(5) >= 5 - payload[:, None]  # the type byte and the last ``payload`` bytes
    keep[:, 0] = True
    at = np.zeros(v.size + 1, dtype=np.int64)
    np.cumsum(payload + 1, out=at[1:])
    return matrix[keep], at


_POS_LIMITS = np.array([1 << 7, 1 << 8, 1 << 16])
_NEG_LIMITS = np.array([-(1 << 15), -(1 << 7), -32])
_PAYLOAD = np.array([0, 1, 2, 4, 4, 2, 1, 0])
_TYPE_BYTE = np.array([0, 0xCC, 0xCD, 0xCE, 0xD2, 0xD1, 0xD0, 0])


def _temperatures(batch: Batch, temperature: float | Mapping[str, float]) -> list[float]:
    if "temperature" in batch.scalars:
        return [float(t) for t in batch.scalars["temperature"]]
    if not isinstance(temperature, Mapping):
        return [float(temperature)] * batch.num_samples
    out = []
    for env in batch.scalars["env"]:
        if env not in temperature:
            raise WireError(f"no temperature for env {env!r} (temperatures given for {sorted(temperature)})")
        out.append(float(temperature[env]))
    return out


def _routed(packer: msgpack.Packer, arr: np.ndarray) -> list[Any]:
    """``[data, shape, dtype]``, with the array's bytes referenced rather than copied."""
    arr = np.ascontiguousarray(arr)
    n = arr.nbytes
    bin_head = b"\xc4" + n.to_bytes(1, "big") if n < 1 << 8 else (
        b"\xc5" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xc6" + n.to_bytes(4, "big"))
    data = arr.reshape(-1).view(np.uint8)  # a flat byte view, also for zero-length arrays
    return [packer.pack_array_header(len(ROUTED_FIELDS)), bin_head, data,
            packer.pack(list(arr.shape)), packer.pack(str(arr.dtype))]


@dataclass
class PrimeRLBatch:
    """A decoded prime-rl ``TrainingBatch``. Each sample is a dict keyed by prime-rl's field names;
    per-token lists are numpy arrays and ``routed_experts`` is an array viewing the payload."""

    sender_id: bytes
    step: int
    samples: list[dict[str, Any]]
    run_idx: int | None = None

    def to_batch(self, run: str | None = None) -> Batch:
        """Our ``Batch`` for these samples (``run`` defaults to the sender id). Scalars: ``env``,
        ``temperature`` (the first token's), and ``advantage`` (the mean of the non-zero per-token
        advantages, as prime-rl reports it; None when a sample has none)."""
        lengths = [int(s["token_ids"].size) for s in self.samples]
        chunks: dict[str, list[np.ndarray]] = {
            "token_ids": [s["token_ids"].astype(np.int32) for s in self.samples],
            "loss_mask": [s["mask"].astype(np.uint8) for s in self.samples],
            "logprobs": [s["logprobs"].astype(np.float32) for s in self.samples],
        }
        routed = [s.get("routed_experts") for s in self.samples]
        if any(r is not None for r in routed):
            if any(r is None for r in routed):
                raise WireError("routed_experts is set on some samples but not all")
            chunks["routed_experts"] = [r for r in routed if r is not None]
        scalars: dict[str, list[Any]] = {
            "env": [s["env_name"] for s in self.samples],
            "temperature": [float(s["temperatures"][0]) if s["temperatures"].size else None for s in self.samples],
            "advantage": [_scalar_advantage(s.get("advantages")) for s in self.samples],
        }
        return Batch.from_columns(run if run is not None else self.sender_id.decode(errors="replace"),
                                  self.step, chunks, lengths, scalars)


def _scalar_advantage(values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    nonzero = values[values != 0.0]
    return float(nonzero.mean()) if nonzero.size else 0.0


def decode_primerl(frames: Sequence[Any]) -> PrimeRLBatch:
    """Read ``[sender_id, payload]`` as prime-rl's trainer would; WireError naming the cause if invalid."""
    if len(frames) != 2:
        raise WireError(f"prime-rl message has {len(frames)} frames, expected 2: [sender_id, payload]")
    sender_id, payload = (bytes(getattr(f, "buffer", f)) for f in frames)
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=True)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"prime-rl payload is not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) < 2:
        raise WireError(f"prime-rl TrainingBatch must be an array of {BATCH_FIELDS}, got {_kind(raw)}")
    examples, step = raw[0], raw[1]
    run_idx = raw[2] if len(raw) > 2 else None
    if not isinstance(examples, list) or not isinstance(step, int) or not isinstance(run_idx, int | None):
        raise WireError(f"prime-rl TrainingBatch fields {BATCH_FIELDS} have types "
                        f"({_kind(examples)}, {_kind(step)}, {_kind(run_idx)}), expected (array, int, int|nil)")
    return PrimeRLBatch(sender_id, step, [_decode_sample(i, s) for i, s in enumerate(examples)], run_idx)


def _decode_sample(i: int, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, list) or len(raw) < REQUIRED_SAMPLE_FIELDS:
        raise WireError(f"prime-rl sample {i} must be an array of at least {REQUIRED_SAMPLE_FIELDS} fields "
                        f"{SAMPLE_FIELDS[:REQUIRED_SAMPLE_FIELDS]}, got {_kind(raw)}")
    out: dict[str, Any] = dict(zip(SAMPLE_FIELDS, raw, strict=False))
    for name in SAMPLE_FIELDS[len(raw):]:
        out[name] = None
    if not isinstance(out["env_name"], str):
        raise WireError(f"prime-rl sample {i}: env_name is a {_kind(out['env_name'])}, not a string")
    n = len(out["token_ids"]) if isinstance(out["token_ids"], list) else -1
    for name, dtype in _PER_TOKEN.items():
        value = out[name]
        if value is None and name not in SAMPLE_FIELDS[:REQUIRED_SAMPLE_FIELDS]:
            continue
        if not isinstance(value, list) or len(value) != n:
            raise WireError(f"prime-rl sample {i}: {name} is {_kind(value)}, expected {n} values like token_ids")
        try:
            out[name] = np.asarray(value, dtype=dtype)
        except (TypeError, ValueError, OverflowError) as e:
            raise WireError(f"prime-rl sample {i}: {name} is not a list of {dtype}: {e}") from None
    if out["routed_experts"] is not None:
        out["routed_experts"] = _decode_routed(i, out["routed_experts"], n)
    return out


def _decode_routed(i: int, raw: Any, tokens: int) -> np.ndarray:
    try:
        data, shape, dtype = raw
        arr = np.frombuffer(data, dtype=np.dtype(dtype)).reshape([int(x) for x in shape])
    except (TypeError, ValueError) as e:
        raise WireError(f"prime-rl sample {i}: routed_experts is not [bytes, shape, dtype] that fit: {e}") from None
    if arr.ndim < 1 or arr.shape[0] != tokens:
        raise WireError(f"prime-rl sample {i}: routed_experts has shape {arr.shape} for {tokens} tokens")
    return arr


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"an array of {len(value)}"
    return "nil" if value is None else type(value).__name__


class PrimeRLSender:
    """Orchestrator side of prime-rl's ZMQ batch transport (``[transport] kind = "prime-rl"``).

    As prime-rl's own orchestrator did at commit 3ab5e04c: a PUSH socket *connected* to the trainer's bound
    PULL at ``address`` (``tcp://TRAINER:PORT``), one ``[sender_id, TrainingBatch]`` message per step. prime-rl's
    trainer sends nothing back, so a step counts as acknowledged once ZMQ has queued it (the high-water mark
    back-pressures), a resumed run cannot learn which steps the trainer holds (it resends from the last
    step queued before the crash), and checkpoints come as marker files (``checkpoint_source = "marker"``).
    """

    def __init__(self, push: zmq.asyncio.Socket, address: str, sender_id: bytes,
                 temperature: float | Mapping[str, float], warn_s: float) -> None:
        self.push, self._address, self.sender_id = push, address, sender_id
        self.temperature, self.warn_s = temperature, warn_s
        self._acked = -1
        self.unacked: dict[int, Any] = {}
        self.bytes_sent = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, address: str, sender_id: bytes, hwm: int = 2, *,
                   temperature: float | Mapping[str, float] = 1.0, warn_s: float = 30.0
                   ) -> AsyncIterator[PrimeRLSender]:
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        try:
            push.setsockopt(zmq.SNDHWM, hwm)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(address)
            yield cls(push, address, sender_id, temperature, warn_s)
        finally:
            push.close()
            ctx.term()

    @property
    def address(self) -> str:
        return self._address

    @property
    def acked(self) -> int:
        return self._acked

    async def wait_acked(self) -> None:
        """Nothing to wait for: prime-rl's trainer does not acknowledge."""

    def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[Checkpoint]:
        if marker_dir is None:
            raise TransportError("kind = 'prime-rl' needs transport.checkpoint_source = 'marker'")
        return marker_announcements(marker_dir)

    async def send(self, batch: Batch) -> bool:
        """Queue one step for the trainer; waits (polling, never blocking the loop) while ZMQ's queue is full
        or no trainer is connected, warning every ``warn_s``."""
        frames = encode_primerl(batch, self.sender_id, temperature=self.temperature)
        await push_polling(self.push, frames, f"step {batch.step} (prime-rl)", self._address, self.warn_s)
        self._acked = batch.step
        self.bytes_sent += sum(len(f) for f in frames)
        return True
