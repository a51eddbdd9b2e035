"""prime-rl's micro-batch message: ``list[MicroBatch]`` for one data rank, as msgspec's msgpack encoder writes it.

prime-rl's trainer (559b447, ``src/prime_rl/transports/rollouts/types.py``) decodes each rank's payload with
``msgspec.msgpack.Decoder(type=list[MicroBatch])``. ``MicroBatch`` is an ``array_like`` struct: a msgpack array
of all 16 fields in the order of ``MICRO_BATCH_FIELDS`` (``nil`` for an unset optional field; with
``array_like``, ``omit_defaults`` shortens nothing). Integers take their smallest msgpack form, floats are
float64, booleans real msgpack booleans (the decoder rejects 0/1), strings str, bytes bin.

``encode_rank`` writes those bytes without msgspec and without per-token Python objects: each per-token field is
msgpack-encoded for a whole micro-batch at once with numpy (a test compares the result with msgspec's own
encoding). It is O(tokens) CPU work and one copy of the payload: run it in a worker thread, not on the event
loop. What we send, per packed token (see ``balance.PackedMicroBatch``; pads in brackets):

- ``input_ids`` the token ids [1]; ``loss_mask`` the loss mask [false] (all false in a dummy);
- ``advantages`` the sample's advantage on its loss-mask tokens, 0.0 elsewhere [0.0] (as prime-rl's
  orchestrator broadcasts a rollout's scalar);
- ``inference_logprobs`` the sampled logprobs [0.0]; ``position_ids`` 0.. per sample [0..pad-1];
- ``sequence_lengths`` and ``seq_lens`` each sample's segment, the pads counted in the last;
- ``temperatures`` the sample's sampling temperature [1.0]; ``env_names`` the sample's env ['']
- ``routed_experts`` ``[data: bin, shape: [tokens, layers, top_k], dtype]`` in the batch's own dtype (uint8, or
  uint16 above 256 experts) [zero rows], or nil; every other optional field nil.

prime-rl's ``MicroBatch`` (559b447) has no field for which policy sampled each token: the batch's ``versions``
column is not sent.

Importable without verifiers.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from orchestrator.columns.layout import REQUIRED, ROUTED
from orchestrator.contracts.wire import Batch
from orchestrator.delivery.balance import BinCost, PackedMicroBatch, pack_ranks, token_count
from orchestrator.errors import WireError

MICRO_BATCH_FIELDS = ("input_ids", "loss_mask", "advantages", "inference_logprobs", "position_ids",
                      "sequence_lengths", "temperatures", "env_names", "seq_lens", "ref_logprobs", "routed_experts",
                      "mm_kwargs", "mm_token_type_ids", "rl_weights", "ce_weights", "ref_kl_weights")
ROUTED_EXPERTS_FIELDS = ("data", "shape", "dtype")
PAD_TOKEN_ID = 1  # prime-rl pads input_ids with the integer 1
_NIL = b"\xc0"
_TRUE, _FALSE = 0xC3, 0xC2


@dataclass
class EncodedStep:
    """One step for prime-rl's trainer: ``messages[r]`` is data rank r's payload (a view of its own buffer)."""

    messages: list[memoryview]
    micro_batches: int  # per rank
    pad_tokens: int
    dummies: int
    truncated: int  # samples cut to seq_len

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.messages)


def encode_step(batch: Batch, *, seq_len: int, ranks: int, pad_to_multiple_of: int = 1,
                temperature: float | Mapping[str, float] = 1.0, bin_cost: BinCost = token_count) -> EncodedStep:
    """Pack ``batch`` for ``ranks`` data ranks (``balance.pack_ranks``) and encode each rank's list.

    The temperature of sample i is ``batch.scalars["temperature"][i]`` if the batch has that scalar, else
    ``temperature`` (one value, or one per env name). Blocking and O(tokens): call it in a worker thread."""
    for name in REQUIRED:
        if name not in batch.columns:
            raise WireError(f"prime-rl's MicroBatch needs column {name!r}; the batch has {sorted(batch.columns)}")
    for name in ("env", "advantage"):
        if name not in batch.scalars:
            raise WireError(f"prime-rl's MicroBatch needs the per-sample scalar {name!r}; the batch has "
                            f"{sorted(batch.scalars)}")
    plan = pack_ranks(batch, seq_len, ranks, pad_to_multiple_of=pad_to_multiple_of, bin_cost=bin_cost)
    temps = sample_temperatures(batch, temperature)
    envs = [msgpack.packb(str(e)) for e in batch.scalars["env"]]
    flat = [mb for rank in plan for mb in rank]
    return EncodedStep([encode_rank(rank, temps, envs) for rank in plan], len(plan[0]),
                       sum(mb.pad for mb in flat), sum(mb.dummy for mb in flat),
                       int(np.count_nonzero(np.diff(batch.offsets) > seq_len)))


def sample_temperatures(batch: Batch, temperature: float | Mapping[str, float]) -> list[float]:
    """Each sample's sampling temperature (see ``encode_step``); WireError for an env without one."""
    if "temperature" in batch.scalars:
        return [float(t) for t in batch.scalars["temperature"]]
    if not isinstance(temperature, Mapping):
        return [float(temperature)] * batch.num_samples
    missing = sorted({str(e) for e in batch.scalars["env"]} - set(temperature))
    if missing:
        raise WireError(f"no temperature for envs {missing} (temperatures given for {sorted(temperature)})")
    return [float(temperature[e]) for e in batch.scalars["env"]]


def encode_rank(micro_batches: Sequence[PackedMicroBatch], temperatures: Sequence[float],
                env_names: Sequence[bytes]) -> memoryview:
    """msgpack ``list[MicroBatch]``; ``temperatures`` and ``env_names`` (msgpack-encoded str) per batch sample."""
    parts: list[Any] = [_array_header(len(micro_batches))]
    for mb in micro_batches:
        parts += _micro_batch(mb, temperatures, env_names)
    return _assemble(parts)


def _assemble(parts: Sequence[bytes | np.ndarray]) -> memoryview:
    """The parts copied once into one new buffer. Not ``b"".join``: numpy copies large parts with the GIL
    released, so the event loop runs meanwhile (joining a 50 MB payload held it for ~100 ms)."""
    views = [np.frombuffer(p, np.uint8) if isinstance(p, bytes) else p.reshape(-1).view(np.uint8) for p in parts]
    out = np.empty(sum(v.size for v in views), np.uint8)
    at = 0
    for v in views:
        out[at:at + v.size] = v
        at += v.size
    return out.data


def _micro_batch(mb: PackedMicroBatch, temperatures: Sequence[float], env_names: Sequence[bytes]) -> list[Any]:
    head = _array_header(mb.num_tokens)
    segments = msgpack.packb(mb.sequence_lengths)
    ids = np.concatenate([mb.batch.columns["token_ids"][mb.index], np.full(mb.pad, PAD_TOKEN_ID)])
    envs = b"".join(env_names[s] * int(n) for s, n in zip(mb.samples.tolist(), mb.lengths.tolist(), strict=True))
    parts: list[Any] = [
        _array_header(len(MICRO_BATCH_FIELDS)),
        head, _ints(ids),
        head, np.where(mb.loss_mask(), _TRUE, _FALSE).astype(np.uint8),
        head, _floats(mb.advantages()),
        head, _floats(mb.column("logprobs", 0.0)),
        head, _ints(mb.position_ids()),
        segments,
        head, _floats(mb.per_token(temperatures, 1.0)),
        head, envs, b"\xa0" * mb.pad,  # env_names; a pad's is "" (fixstr of length 0)
        segments,  # seq_lens: one segment per sample, as sequence_lengths
        _NIL,  # ref_logprobs
    ]
    parts += _routed(mb) if ROUTED in mb.batch.columns and mb.samples.size else [_NIL]  # prime-rl: nil in an empty bin
    parts.append(_NIL * 5)  # mm_kwargs, mm_token_type_ids, rl_weights, ce_weights, ref_kl_weights
    return parts


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else \
        b"\xdd" + n.to_bytes(4, "big")


def _floats(values: np.ndarray) -> np.ndarray:
    """msgpack float64 encoding of every value, concatenated: 9 bytes each (0xcb, big-endian double)."""
    out = np.empty((values.size, 9), dtype=np.uint8)
    out[:, 0] = 0xCB
    out[:, 1:] = values.astype(">f8").view(np.uint8).reshape(-1, 8)
    return out.reshape(-1)


def _ints(values: np.ndarray) -> np.ndarray:
    """msgpack encoding of every int in its smallest form (as msgpack and msgspec write them), concatenated.
    Covers the int32 and uint32 ranges."""
    v = values.astype(np.int64).reshape(-1)
    if v.size and (v.min() < -(1 << 31) or v.max() >= 1 << 32):
        raise WireError(f"integer out of the int32/uint32 range: {v.min()}..{v.max()}")
    # kinds 0-3: fixint, uint8, uint16, uint32 (v >= 0); 4-7: int32, int16, int8, negative fixint
    kind = np.where(v >= 0, np.searchsorted(_POS_LIMITS, v, side="right"),
                    4 + np.searchsorted(_NEG_LIMITS, v, side="right"))
    payload = _PAYLOAD[kind]  # bytes after the type byte
    matrix = np.empty((v.size, 5), dtype=np.uint8)
    matrix[:, 0] = np.where(payload == 0, v & 0xFF, _TYPE_BYTE[kind])
    matrix[:, 1:] = (v & 0xFFFFFFFF).astype(">u4").view(np.uint8).reshape(-1, 4)
    keep = np.arange(5) >= 5 - payload[:, None]  # the type byte and the last ``payload`` bytes
    keep[:, 0] = True
    out: np.ndarray = matrix[keep]
    return out


_POS_LIMITS = np.array([1 << 7, 1 << 8, 1 << 16])
_NEG_LIMITS = np.array([-(1 << 15), -(1 << 7), -32])
_PAYLOAD = np.array([0, 1, 2, 4, 4, 2, 1, 0])
_TYPE_BYTE = np.array([0, 0xCC, 0xCD, 0xCE, 0xD2, 0xD1, 0xD0, 0])


def _routed(mb: PackedMicroBatch) -> list[Any]:
    """``[data, shape, dtype]``: the rows' C-order bytes as msgpack bin (views of each sample's rows, then zero
    rows for the pads: copied once, by ``_assemble``), the shape, the numpy dtype name."""
    col = mb.batch.columns[ROUTED]
    rows = [np.ascontiguousarray(col[a:a + n]) for a, n in zip(mb.batch.offsets[mb.samples].tolist(),
                                                               mb.lengths.tolist(), strict=True)]
    rows.append(np.zeros((mb.pad, *col.shape[1:]), col.dtype))
    shape = [mb.num_tokens, *col.shape[1:]]
    n = mb.num_tokens * int(np.prod(col.shape[1:], dtype=np.int64)) * col.dtype.itemsize
    bin_head = b"\xc4" + struct.pack(">B", n) if n < 1 << 8 else (
        b"\xc5" + struct.pack(">H", n) if n < 1 << 16 else b"\xc6" + struct.pack(">I", n))
    return [_array_header(len(ROUTED_EXPERTS_FIELDS)), bin_head, *rows, msgpack.packb(shape),
            msgpack.packb(str(col.dtype))]
