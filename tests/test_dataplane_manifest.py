"""The step manifest: built from record headers only, round-tripped, and refused when corrupt or hostile."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from orchestrator.columns.layout import ALIGN, RoutedDtype, SpanLoc, span_layout
from orchestrator.contracts.manifest import (
    MAX_MANIFEST_BYTES,
    StepManifest,
    build_manifest,
    decode_manifest,
    encode_manifest,
)
from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord
from orchestrator.errors import WireError

POOLS = {"w0": PoolInfo(id="p0", size=1 << 20, host="node-a", path="/run/job/pools/w0.pool"),
         "w1": PoolInfo(id="p1", size=1 << 20, host="node-a", path="/run/job/pools/w1.pool")}


def record(rid: str, worker: str, offset: int, samples: list[tuple[int, int, int]], routed: RoutedDtype = "uint8",
           pool: str | None = None, policy: int = 12) -> RolloutRecord:
    """A direct-mode record as the hub holds it: a header whose span fits its samples' layout."""
    tokens = sum(s[0] for s in samples)
    nbytes = span_layout(tokens, samples[0][1], samples[0][2], routed).nbytes
    header = RolloutHeader(rid=rid, group="g", env="e", task=0, policy_step=policy, worker=worker, server="s", ok=True,
                           reward=1.0, samples=samples, routed_dtype=routed,
                           tokens=tokens, span=SpanLoc(pool or POOLS[worker].id, offset, nbytes))
    record = RolloutRecord(header, [])
    record.check()
    return record


def step_manifest(routed: tuple[int, int] = (4, 2)) -> StepManifest:
    trained = [(record("r0", "w0", 0, [(10, *routed), (6, *routed)]), 0.5),
               (record("r1", "w1", 4096, [(7, *routed)], policy=11), -0.5),
               (record("r2", "w0", 8192, [(3, *routed)]), 0.0)]
    return build_manifest("run", 12, trained, POOLS)


def test_a_manifest_is_built_from_headers_and_round_trips() -> None:
    m = step_manifest()
    assert [(p.worker, p.id) for p in m.pools] == [("w0", "p0"), ("w1", "p1")]
    assert [(s.pool, s.offset, s.tokens, s.rollout) for s in m.spans] == [(0, 0, 16, "r0"), (1, 4096, 7, "r1"),
                                                                          (0, 8192, 3, "r2")]
    assert [(s.span, s.start, s.tokens) for s in m.samples] == [(0, 0, 10), (0, 10, 6), (1, 0, 7), (2, 0, 3)]
    assert [(c.name, c.dtype, c.tail) for c in m.columns] == [
        ("token_ids", "<i4", []), ("loss_mask", "|u1", []), ("logprobs", "<f4", []), ("routed_experts", "|u1", [4, 2])]
    assert m.scalars == {"advantage": [0.5, 0.5, -0.5, 0.0], "reward": [1.0] * 4, "env": ["e"] * 4,
                         "rollout": ["r0", "r0", "r1", "r2"], "policy": [12, 12, 11, 12],
                         "policy_max": [12, 12, 11, 12], "min_version": [None] * 4}
    data = encode_manifest(m)
    assert decode_manifest(data) == m
    assert decode_manifest(memoryview(data)) == m
    assert len(data) < 600  # headers only: the bytes of the columns are not in it


def test_a_step_without_routed_experts_or_with_mixed_shapes_carries_token_columns_only() -> None:
    assert [c.name for c in step_manifest(routed=(0, 0)).columns] == ["token_ids", "loss_mask", "logprobs"]
    trained = [(record("r0", "w0", 0, [(4, 4, 2)]), 1.0), (record("r1", "w0", 4096, [(4, 2, 2)]), 1.0)]
    m = build_manifest("run", 0, trained, POOLS)
    assert [c.name for c in m.columns] == ["token_ids", "loss_mask", "logprobs"]
    assert decode_manifest(encode_manifest(m)) == m
    empty = build_manifest("run", 1, [], POOLS)
    assert decode_manifest(encode_manifest(empty)) == empty


def test_a_record_whose_worker_renewed_its_pool_cannot_be_in_a_manifest() -> None:
    stale = record("r0", "w0", 0, [(4, 0, 0)], pool="p-old")
    with pytest.raises(WireError, match="not in env worker w0's current pool"):
        build_manifest("run", 0, [(stale, 1.0)], POOLS)
    with pytest.raises(WireError, match="current pool"):
        build_manifest("run", 0, [(record("r0", "w0", 0, [(4, 0, 0)]), 1.0)], {})  # a worker not known


Mutation = Callable[[dict[str, Any]], object]


def set_(path: str, value: Any) -> Mutation:
    """Set ``value`` at a dotted path (list indices as numbers) of the manifest's plain data."""
    def apply(d: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = d
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return apply


HOSTILE: list[tuple[str, Mutation, str]] = [
    ("wrong-kind", set_("kind", "batch"), "not a step manifest of version 1"),
    ("future-version", set_("v", 3), "version 3"),
    ("unknown-field", set_("extra", 1), "unknown field"),
    ("negative-step", set_("step", -1), ">= 0"),
    ("empty-run", set_("run", ""), "length >= 1"),
    ("unaligned-span", set_("spans.1.1", 4097), "not an aligned range"),
    ("span-past-its-pool", set_("spans.1.1", (1 << 20) - ALIGN), "not an aligned range"),
    ("span-in-a-missing-pool", set_("spans.1.0", 7), "names pool 7"),
    ("overlapping-spans", set_("spans.2.1", 64), "overlap"),
    ("huge-routed-shape", set_("spans.0.3", 1 << 20), "<= 4096"),
    ("routed-dtype", set_("spans.0.5", "int64"), "Invalid enum value 'int64'"),
    ("sample-past-its-span", set_("samples.1.2", 7), "does not continue span 0"),
    ("sample-skipping-tokens", set_("samples.1.1", 11), "does not continue span 0"),
    ("sample-in-a-missing-span", set_("samples.3.0", 9), "names span 9"),
    ("spans-not-covered", lambda d: d["samples"].pop(), "not all 3 spans"),
    ("columns-tampered", set_("columns.3.1", "<u2"), "do not follow from its spans"),
    ("scalar-too-short", lambda d: d["scalars"]["reward"].pop(), "has 3 values for 4 samples"),
    ("nan-advantage", set_("scalars.advantage.0", float("nan")), "finite advantage"),
    ("string-advantage", set_("scalars.advantage.0", "1"), "finite advantage"),
    ("no-advantage", lambda d: d["scalars"].pop("advantage"), "finite advantage"),
    ("nested-scalar", set_("scalars.env.0", {"a": 1}), "got `object`"),
    ("duplicate-pool", set_("pools.1.id", "p0"), "appears twice"),
    ("long-socket-path", set_("pools.0.path", "/" + "x" * 200), "length <= 107"),
    ("duplicate-rollout", set_("spans.2.6", "r0"), "a rollout appears in two spans"),
]


@pytest.mark.parametrize(("mutate", "expected"), [(m, e) for _, m, e in HOSTILE], ids=[i for i, _, _ in HOSTILE])
def test_a_corrupt_or_hostile_manifest_is_refused_naming_the_problem(mutate: Mutation, expected: str) -> None:
    data = msgspec.to_builtins(step_manifest())
    mutate(data)
    with pytest.raises(WireError, match=None) as caught:
        decode_manifest(msgspec.msgpack.encode(data))
    assert expected in str(caught.value)


@pytest.mark.parametrize(("data", "expected"), [
    (b"", "not a step manifest"), (b"\xc1", "not a step manifest"),
    (msgspec.msgpack.encode([1, 2]), "Expected `object`"), (bytes(MAX_MANIFEST_BYTES + 1), "more than the"),
])
def test_bytes_that_are_no_manifest_are_refused(data: bytes, expected: str) -> None:
    with pytest.raises(WireError) as caught:
        decode_manifest(data)
    assert expected in str(caught.value)


def test_random_corruption_is_refused_or_yields_a_valid_manifest() -> None:
    rnd = random.Random(20)
    good = encode_manifest(step_manifest())
    refused = 0
    for _ in range(2000):  # bounded; each is microseconds
        data = bytearray(good)
        for _ in range(rnd.randint(1, 4)):
            data[rnd.randrange(len(data))] = rnd.randrange(256)
        try:
            m = decode_manifest(bytes(data))
        except WireError:
            refused += 1
            continue
        assert decode_manifest(encode_manifest(m)) == m  # what passes is a consistent manifest
    assert refused > 1000  # most flips break something; the rest changed a value within its bounds


def test_a_version_1_manifest_is_read_as_spans_without_optional_columns() -> None:
    m = step_manifest()
    old = msgspec.msgpack.decode(encode_manifest(m))
    old["v"] = 1
    old["spans"] = [span[:7] for span in old["spans"]]  # a version 1 span: no optional columns
    read = decode_manifest(msgspec.msgpack.encode(old))
    assert read.v == 1
    assert [s.optional for s in read.spans] == [[], [], []]
    assert read.columns == m.columns
    with_versions = msgspec.msgpack.decode(encode_manifest(m))
    with_versions["v"] = 1
    with_versions["spans"][0][7] = ["versions"]
    with pytest.raises(WireError, match="optional columns in a version 1 manifest"):
        decode_manifest(msgspec.msgpack.encode(with_versions))


def test_a_step_carries_an_optional_column_only_when_every_span_has_it() -> None:
    def with_versions(rid: str, worker: str, offset: int, has: bool) -> RolloutRecord:
        r = record(rid, worker, offset, [(10, 0, 0)])
        if has:
            r.header.optional = ["versions"]
            assert r.header.span is not None
            r.header.span = SpanLoc(r.header.span.pool, offset, span_layout(10, 0, 0, "uint8", ["versions"]).nbytes)
        r.check()
        return r

    both = build_manifest("run", 1, [(with_versions("a", "w0", 0, True), 0.1),
                                     (with_versions("b", "w1", 0, True), 0.2)], POOLS)
    assert [c.name for c in decode_manifest(encode_manifest(both)).columns] == [
        "token_ids", "loss_mask", "logprobs", "versions"]
    one = build_manifest("run", 1, [(with_versions("a", "w0", 0, True), 0.1),
                                    (with_versions("b", "w1", 0, False), 0.2)], POOLS)
    assert [c.name for c in decode_manifest(encode_manifest(one)).columns] == ["token_ids", "loss_mask", "logprobs"]
    unknown = msgspec.msgpack.decode(encode_manifest(both))
    unknown["spans"][0][7] = ["teacher_secrets"]
    with pytest.raises(WireError, match="unknown optional columns"):
        decode_manifest(msgspec.msgpack.encode(unknown))
