from __future__ import annotations

from typing import Any

import msgpack
import numpy as np
import pytest

from orchestrator.errors import WireError
from orchestrator.transport import Batch, decode_primerl, encode_primerl
from orchestrator.transport.primerl import SAMPLE_FIELDS

# prime-rl's TrainingSample fields, in declaration order (src/prime_rl/transport/types.py at 3ab5e04c)
PRIMERL_SAMPLE_ORDER = ["token_ids", "mask", "logprobs", "temperatures", "env_name", "ref_logprobs", "mm_kwargs",
                        "routed_experts", "mm_token_type_ids", "rl_weights", "ce_weights", "ref_kl_weights",
                        "advantages"]

# msgspec 0.22.0's msgspec.msgpack.encode of prime-rl's TrainingBatch (structs as declared at 3ab5e04c) for
# the batch golden_batch() builds, sent with temperature 0.7: the bytes a prime-rl orchestrator would send.
GOLDEN = (
    "93929d9301ccc8ce0001117093c2c3c393cb0000000000000000cbbfe0000000000000cbbff400000000000093cb3fe666666666"
    "6666cb3fe6666666666666cb3fe6666666666666a567736d386bc0c093c40600010203040593030201a575696e7438c0c0c0c093"
    "cb0000000000000000cb3fe0000000000000cb3fe00000000000009d92050692c2c392cb0000000000000000cbc0000000000000"
    "0092cb3fe6666666666666cb3fe6666666666666a46d617468c0c093c4040607080993020201a575696e7438c0c0c0c092cb0000"
    "000000000000cbbff000000000000007c0"
)


def golden_batch() -> Batch:
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [np.array([1, 200, 70000], np.int32), np.array([5, 6], np.int32)],
        "loss_mask": [np.array([0, 1, 1], np.uint8), np.array([0, 1], np.uint8)],
        "logprobs": [np.array([0.0, -0.5, -1.25], np.float32), np.array([0.0, -2.0], np.float32)],
        "routed_experts": [np.arange(6, dtype=np.uint8).reshape(3, 2, 1),
                           np.arange(6, 10, dtype=np.uint8).reshape(2, 2, 1)],
    }
    scalars: dict[str, list[Any]] = {"advantage": [0.5, -1.0], "reward": [1.0, 0.0], "env": ["gsm8k", "math"],
                                     "rollout": ["r0", "r1"]}
    return Batch.from_columns("run", 7, chunks, [3, 2], scalars)


def make_batch(lengths: tuple[int, ...] = (4, 7, 1), routed: bool = True, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    chunks: dict[str, list[np.ndarray]] = {
        "token_ids": [rng.integers(0, 150_000, n, dtype=np.int32) for n in lengths],
        "loss_mask": [rng.integers(0, 2, n).astype(np.uint8) for n in lengths],
        "logprobs": [rng.normal(size=n).astype(np.float32) for n in lengths],
    }
    for m in chunks["loss_mask"]:
        m[-1:] = 1  # every (non-empty) sample trains on at least one token
    if routed:
        chunks["routed_experts"] = [rng.integers(0, 128, (n, 3, 2), dtype=np.uint8) for n in lengths]
    scalars: dict[str, list[Any]] = {"advantage": [float(x) for x in rng.normal(size=len(lengths))],
               "env": [f"env{i % 2}" for i in range(len(lengths))]}
    return Batch.from_columns("run", 3, chunks, list(lengths), scalars)


def raw_samples(frames: list[bytes]) -> tuple[list[Any], list[list[Any]]]:
    raw = msgpack.unpackb(frames[1], raw=False)
    return raw, raw[0]


def test_bytes_equal_what_msgspec_encodes_for_prime_rl() -> None:
    frames = encode_primerl(golden_batch(), b"run_a", temperature=0.7)
    assert frames[0] == b"run_a"
    assert frames[1].hex() == GOLDEN


def reference_payload(batch: Batch, temperature: float) -> bytes:
    """The payload built the plain way: nested Python lists through msgpack.packb."""
    samples = []
    for i in range(batch.num_samples):
        s = batch.sample(i)
        mask = s["loss_mask"].astype(bool)
        routed = s.get("routed_experts")
        samples.append([s["token_ids"].tolist(), mask.tolist(), s["logprobs"].tolist(), [temperature] * mask.size,
                        s["env"], None, None,
                        None if routed is None else [routed.tobytes(), list(routed.shape), str(routed.dtype)],
                        None, None, None, None,
                        None if s["advantage"] is None else np.where(mask, s["advantage"], 0.0).tolist()])
    out: bytes = msgpack.packb([samples, batch.step, None], use_bin_type=True)
    return out


@pytest.mark.parametrize("routed", [True, False])
def test_vectorised_encoding_equals_plain_msgpack(routed: bool) -> None:
    edges = np.array([0, 1, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, -1, -32, -33, -128, -129, -32768,
                      -32769, -(2**31)], dtype=np.int32)
    lengths = (0, 1, 15, 16, 17, 300, 70_000)
    batch = make_batch(lengths, routed=routed, seed=4)
    rng = np.random.default_rng(4)
    batch.columns["token_ids"][:] = rng.choice(edges, batch.num_tokens)
    batch.scalars["advantage"][2] = None
    assert encode_primerl(batch, b"run", temperature=0.3)[1] == reference_payload(batch, 0.3)


def test_field_order_matches_prime_rl() -> None:
    assert list(SAMPLE_FIELDS) == PRIMERL_SAMPLE_ORDER
    raw, samples = raw_samples(encode_primerl(make_batch(), b"run"))
    assert len(raw) == 3  # TrainingBatch: examples, step, run_idx
    assert (raw[1], raw[2]) == (3, None)
    assert len(samples) == 3
    for i, s in enumerate(samples):
        assert len(s) == 13
        assert s[4] == f"env{i % 2}"
        for name in ("ref_logprobs", "mm_kwargs", "mm_token_type_ids", "rl_weights", "ce_weights", "ref_kl_weights"):
            assert s[PRIMERL_SAMPLE_ORDER.index(name)] is None, name


def test_per_sample_token_columns() -> None:
    batch = make_batch()
    _, samples = raw_samples(encode_primerl(batch, b"run", temperature=0.5))
    for i, s in enumerate(samples):
        ours = batch.sample(i)
        assert s[0] == ours["token_ids"].tolist()
        assert s[1] == [bool(m) for m in ours["loss_mask"]]
        assert all(type(m) is bool for m in s[1])
        assert s[2] == ours["logprobs"].astype(float).tolist()
        assert s[3] == [0.5] * len(s[0])
        expected_adv = [ours["advantage"] if m else 0.0 for m in ours["loss_mask"]]
        assert s[12] == expected_adv


def test_routed_experts_are_bytes_shape_dtype() -> None:
    batch = make_batch()
    _, samples = raw_samples(encode_primerl(batch, b"run"))
    for i, s in enumerate(samples):
        routed = batch.sample(i)["routed_experts"]
        data, shape, dtype = s[7]
        assert isinstance(data, bytes)
        assert data == routed.tobytes()
        assert shape == [routed.shape[0], 3, 2]
        assert dtype == "uint8"
    _, samples = raw_samples(encode_primerl(make_batch(routed=False), b"run"))
    assert all(s[7] is None for s in samples)


def test_round_trip_to_our_batch() -> None:
    batch = make_batch()
    decoded = decode_primerl(encode_primerl(batch, b"run_x", temperature={"env0": 0.6, "env1": 1.0}))
    assert (decoded.sender_id, decoded.step, decoded.run_idx) == (b"run_x", 3, None)
    assert decoded.samples[1]["routed_experts"].shape == (7, 3, 2)
    back = decoded.to_batch()
    assert (back.run, back.step, back.num_samples) == ("run_x", 3, 3)
    np.testing.assert_array_equal(back.offsets, batch.offsets)
    for name, col in batch.columns.items():
        assert back.columns[name].dtype == col.dtype, name
        np.testing.assert_array_equal(back.columns[name], col)
    assert back.scalars["env"] == batch.scalars["env"]
    assert back.scalars["advantage"] == pytest.approx(batch.scalars["advantage"])
    assert back.scalars["temperature"] == [0.6, 1.0, 0.6]


def test_temperature_from_scalars_or_per_env() -> None:
    batch = make_batch()
    with pytest.raises(WireError, match="no temperature for env 'env1'"):
        encode_primerl(batch, b"run", temperature={"env0": 0.6})
    batch.scalars["temperature"] = [0.1, 0.2, 0.3]
    _, samples = raw_samples(encode_primerl(batch, b"run", temperature={"env0": 0.6}))
    assert [s[3][0] for s in samples] == [0.1, 0.2, 0.3]


def test_sample_without_advantage_sends_no_advantage_stream() -> None:
    batch = make_batch()
    batch.scalars["advantage"] = [None, 1.0, None]
    raw, samples = raw_samples(encode_primerl(batch, b"run"))
    assert [s[12] is None for s in samples] == [True, False, True]
    assert decode_primerl([b"run", msgpack.packb(raw)]).to_batch().scalars["advantage"] == [None, 1.0, None]


def test_empty_batch() -> None:
    batch = make_batch(lengths=())
    decoded = decode_primerl(encode_primerl(batch, b"run"))
    assert decoded.samples == []
    assert decoded.to_batch().num_samples == 0


def test_encoder_names_what_is_missing() -> None:
    batch = make_batch()
    del batch.columns["logprobs"]
    with pytest.raises(WireError, match="needs column 'logprobs'"):
        encode_primerl(batch, b"run")
    with pytest.raises(TypeError, match="sender_id must be bytes"):
        encode_primerl(make_batch(), "run")  # type: ignore[arg-type]


def _mangle_sample(change: Any) -> list[bytes]:
    raw, samples = raw_samples(encode_primerl(make_batch(), b"run"))
    change(samples[1])
    return [b"run", msgpack.packb(raw, use_bin_type=True)]


@pytest.mark.parametrize(("frames", "message"), [
    (lambda: [b"only one frame"], "has 1 frames, expected 2"),
    (lambda: [b"run", b"\xc1"], "not msgpack"),
    (lambda: [b"run", msgpack.packb({"examples": []})], "must be an array"),
    (lambda: [b"run", msgpack.packb([[], "7"])], "expected \\(array, int, int\\|nil\\)"),
    (lambda: _mangle_sample(lambda s: s.__delitem__(slice(4, None))), "sample 1 must be an array of at least 5"),
    (lambda: _mangle_sample(lambda s: s[1].pop()), "sample 1: mask is an array of 6, expected 7"),
    (lambda: _mangle_sample(lambda s: s.__setitem__(4, 5)), "sample 1: env_name is a int"),
    (lambda: _mangle_sample(lambda s: s[7].__setitem__(1, [6, 3, 2])), "routed_experts"),
    (lambda: _mangle_sample(lambda s: s[7].__setitem__(1, [7, 3, 2, 9])), "routed_experts is not"),
])
def test_corrupt_payloads_are_wire_errors(frames: Any, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode_primerl(frames())


def test_decodes_with_prime_rl_structs_when_msgspec_is_installed() -> None:
    msgspec = pytest.importorskip("msgspec")

    opts = {"array_like": True, "gc": False, "omit_defaults": True}
    routed_experts = msgspec.defstruct("RoutedExperts", [("data", bytes), ("shape", list[int]), ("dtype", str)],
                                       **opts)
    optional_floats = (list[float] | None, None)
    training_sample = msgspec.defstruct("TrainingSample", [
        ("token_ids", list[int]), ("mask", list[bool]), ("logprobs", list[float]), ("temperatures", list[float]),
        ("env_name", str), ("ref_logprobs", *optional_floats), ("mm_kwargs", dict[str, Any] | None, None),
        ("routed_experts", routed_experts | None, None), ("mm_token_type_ids", list[int] | None, None),
        ("rl_weights", *optional_floats), ("ce_weights", *optional_floats), ("ref_kl_weights", *optional_floats),
        ("advantages", *optional_floats),
    ], **opts)
    training_batch = msgspec.defstruct("TrainingBatch", [
        ("examples", list[training_sample]),  # type: ignore[valid-type]
        ("step", int), ("run_idx", int | None, None)], **opts)

    batch = make_batch()
    payload = encode_primerl(batch, b"run")[1]
    decoded = msgspec.msgpack.Decoder(type=training_batch).decode(payload)
    assert decoded.step == 3
    assert decoded.examples[1].token_ids == batch.sample(1)["token_ids"].tolist()
    assert decoded.examples[1].routed_experts.shape == [7, 3, 2]
    assert msgspec.msgpack.encode(decoded) == payload
