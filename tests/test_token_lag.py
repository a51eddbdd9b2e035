"""Token-level staleness: ``max_token_lag`` masks tokens older than its floor out of the loss and drops samples left
with nothing to train, the same way on both data planes; the trainer library reads which weights sampled each token;
a rollout's versions are bounded by the weights its server could have had when it came back."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import numpy as np
import pytest

from orchestrator.columns.layout import SpanLoc, shapes_layout
from orchestrator.columns.samples import PlainNode, Sample, build_sample
from orchestrator.columns.store import sample_optional
from orchestrator.columns.versions import NOT_SAMPLED, CallKey, CallSpans, TokenVersions, bounded, call_key, summary
from orchestrator.config import load_config
from orchestrator.contracts.manifest import (
    PoolRef,
    SampleRef,
    SpanRef,
    StepManifest,
    build_manifest,
    decode_manifest,
    encode_manifest,
    expected_columns,
)
from orchestrator.contracts.protocol import PoolInfo, RolloutHeader, RolloutRecord, sample_frames
from orchestrator.contracts.wire import Batch
from orchestrator.errors import ConfigError, Failure, WireError
from orchestrator.inference.pool import Server
from orchestrator.rollouts.groups import Group, GroupTracker
from orchestrator.scoring.token_lag import LAG_FILTER, TokenLag
from orchestrator.steps.boundary import StepBuilder
from orchestrator.steps.dump import ReplayGroup
from orchestrator.testing.jobs import ARITHMETIC, write_job_toml
from orchestrator.testing.sim import FakeInferenceServer
from orchestrator.testing.steps import synthetic_config
from orchestrator.trainer.reader import StepView
from orchestrator.trainer.versions import clean_context, cut_by_sync, sampled_by, version_bounds

STEP = 5


def turns(per_turn: tuple[tuple[int, int], ...], policy: int) -> Sample:
    """A multi-turn sample: per turn a 2-token prompt and ``n`` tokens its server said step ``v`` sampled."""
    nodes: list[PlainNode] = []
    calls: dict[CallKey, list[CallSpans]] = {}
    at = 0
    for t, (v, n) in enumerate(per_turn):
        completion = list(range(10 * t, 10 * t + n))
        calls[call_key(at + 2, completion)] = [((v, 0, n),)]  # the call's prompt: everything before it
        nodes += [PlainNode([100 + t, 101 + t]), PlainNode(completion, [True] * n, [-1.0] * n)]
        at += 2 + n
    return build_sample(nodes, TokenVersions(policy, calls))


def rollout(rid: str, env: str, samples_versions: list[tuple[tuple[int, int], ...]], policy: int) -> RolloutRecord:
    """A through-plane record whose samples' tokens were sampled by the steps given (exact versions)."""
    samples = [turns(per_turn, policy) for per_turn in samples_versions]
    shapes, frames = sample_frames(samples)
    header = RolloutHeader(rid=rid, group="g", env=env, task=0, policy_step=policy, worker="w", server="s", ok=True,
                           reward=1.0, samples=shapes, tokens=sum(s[0] for s in shapes),
                           optional=list(sample_optional(samples)), frames=len(frames),
                           versions=[summary(s.versions, s.loss_mask) for s in samples if s.versions is not None])
    record = RolloutRecord(header, [memoryview(f if isinstance(f, bytes) else f.tobytes()) for f in frames])
    record.check()
    return record


def builder(limit: int | None) -> StepBuilder:
    """synth-a with ``max_token_lag = limit``, synth-b without one."""
    cfg = synthetic_config(8, group_size=2)
    envs = [dataclasses.replace(e, max_token_lag=limit) if e.name == "synth-a" else e for e in cfg.env]
    pipeline = dataclasses.replace(cfg.pipeline, filters=())  # one-rollout groups: advantage 0, trained all the same
    return StepBuilder(pipeline, envs, "run", vocab_size=1 << 17)


def records() -> list[RolloutRecord]:
    return [
        rollout("fresh", "synth-a", [((5, 3),)], 5),  # all of step 5
        rollout("mixed", "synth-a", [((4, 2), (5, 3))], 4),  # 2 tokens of step 4 (stale at lag 0), 3 of step 5
        rollout("old", "synth-a", [((4, 3),)], 4),  # nothing left at lag 0: dropped
        rollout("branches", "synth-a", [((4, 2),), ((4, 1), (5, 2))], 4),  # one branch dropped, one masked
        rollout("nolimit", "synth-b", [((3, 2),)], 3),  # another env without a limit: old, kept whole
    ]


def test_a_plan_reads_headers_alone() -> None:
    lag = TokenLag({"synth-a": 0, "synth-b": None})
    plans = {r.rid: lag.plan(r.header, STEP) for r in records()}
    assert {k: (p.keep, p.masked, p.floor) for k, p in plans.items()} == {
        "fresh": ([True], 0, 5), "mixed": ([True], 2, 5), "old": ([False], 3, 5),
        "branches": ([False, True], 3, 5), "nolimit": ([True], 0, None)}
    stats = lag.stats(STEP, [r.header for r in records()])
    assert stats == {"exact": 18, "bounded": 0, "mixed_samples": 2, "masked": 8, "dropped_samples": 2,
                     "by_lag": {"0": 8, "1": 8, "2": 2}}


def test_both_data_planes_mask_and_drop_the_same_tokens() -> None:
    b = builder(0)
    recs = records()
    groups = [ReplayGroup("g", r.env, 0, r.header.policy_step, 1, [r]) for r in recs]
    for g in groups:
        g.records[0].header.group = g.gid
    result = b.build(STEP, groups)
    rows = {r.rollout: r for r in result.rows}
    assert (rows["old"].filtered, rows["old"].filters) == (True, [LAG_FILTER])  # nothing left to train: not in it
    assert (rows["mixed"].filtered, rows["mixed"].masked_tokens) == (False, 2)
    assert "masked_tokens" not in rows["nolimit"].as_dict()  # its env has no limit
    batch = result.batch
    assert batch.scalars["rollout"] == ["fresh", "mixed", "branches", "nolimit"]  # "branches" keeps one of two
    assert batch.scalars["min_version"] == [5, 5, 5, None]
    versions, mask = batch.columns["versions"], batch.columns["loss_mask"]
    limited = np.repeat([f is not None for f in batch.scalars["min_version"]], np.diff(batch.offsets))
    stale = limited & (versions != NOT_SAMPLED) & (versions < STEP)
    assert stale.any()
    assert not mask[stale].any()  # every token below its floor is out of the loss ...
    assert mask[(versions != NOT_SAMPLED) & ~stale].all()  # ... and every other sampled token is in it
    assert (result.versions["masked"], result.versions["dropped_samples"]) == (8, 2)

    # the direct plane: a manifest of the same records, read by the trainer library's StepView
    trained = [(r, 0.0) for r in recs if r.rid != "old"]
    spans = [{name: r.column(name) for name in ("token_ids", "loss_mask", "logprobs", "versions")} for r, _ in trained]
    pools = {"w": PoolInfo(id="p", size=1 << 20, host="h", path=None)}
    at = 0
    for r, _ in trained:  # a span each in a pool (build_manifest reads only the headers' numbers)
        nbytes = shapes_layout(r.header.samples, r.header.routed_dtype, r.header.optional).nbytes
        r.header.span, at = SpanLoc("p", at, nbytes), at + nbytes
    manifest = decode_manifest(encode_manifest(build_manifest("run", STEP, trained, pools,
                                                              plan=lambda h: b.lag.keep(h, STEP))))
    assert [s.start for s in manifest.samples if manifest.spans[s.span].rollout == "branches"] == [4]  # a gap
    direct = StepView(manifest, spans).gather()
    for name in ("token_ids", "loss_mask", "versions", "logprobs"):
        np.testing.assert_array_equal(direct.columns[name], batch.columns[name], err_msg=name)
    assert direct.scalars["min_version"] == batch.scalars["min_version"]
    one = StepView(manifest, spans).sample(1)  # "mixed", viewed alone
    assert one["loss_mask"].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]


def test_a_version_2_manifest_may_leave_a_dropped_sample_out_but_not_overlap() -> None:
    pools = [PoolRef(worker="w", id="p", size=1 << 20, host="h")]
    spans = [SpanRef(0, 0, 10, 0, 0, "uint8", "r")]
    gap = StepManifest(run="r", step=1, pools=pools, spans=spans, samples=[SampleRef(0, 4, 6)],
                       columns=expected_columns(spans), scalars={"advantage": [0.0]})
    assert decode_manifest(encode_manifest(gap)).samples == [SampleRef(0, 4, 6)]  # tokens 0..4: a dropped sample
    as_v1 = msgspec.to_builtins(gap)
    as_v1["v"] = 1
    with pytest.raises(WireError, match="does not continue span 0 at token 0"):
        decode_manifest(msgspec.msgpack.encode(as_v1))  # version 1: samples tile their spans
    overlap = msgspec.to_builtins(gap)
    overlap["samples"] = [[0, 0, 6], [0, 4, 6]]
    overlap["scalars"] = {"advantage": [0.0, 0.0]}
    with pytest.raises(WireError, match="does not continue span 0 at token 6"):
        decode_manifest(msgspec.msgpack.encode(overlap))


def test_the_trainer_reads_which_weights_sampled_each_token() -> None:
    v = np.array([-1, 5, 5, bounded(4), -1, 6, 6], np.int32)
    batch = Batch("r", 6, {"versions": v, "loss_mask": (v != -1).astype(np.uint8)}, np.array([0, 4, 7]),
                  {"policy": [4, 6], "policy_max": [6, 6]})
    lo, hi = version_bounds(batch)
    assert lo.tolist() == [-1, 5, 5, 4, -1, 6, 6]
    assert hi.tolist() == [-1, 5, 5, 6, -1, 6, 6]  # bounded: up to its sample's policy_max
    assert sampled_by(batch).tolist() == [False, False, False, False, False, True, True]
    assert sampled_by(batch, 5).tolist() == [False, True, True, False, False, False, False]
    assert clean_context(batch).tolist() == [False] * 4 + [False, True, True]  # sample 0 began under 4
    assert not cut_by_sync(batch).any()  # no reply holds two exact versions
    pinned = Batch("r", 4, {"versions": np.array([bounded(4)], np.int32)}, np.array([0, 1]),
                   {"policy": [4], "policy_max": [4]})
    assert sampled_by(pinned).tolist() == [True]  # bounds that meet: no sync while it was in flight
    old = Batch("r", 3, {"loss_mask": np.ones(2, np.uint8)}, np.array([0, 1, 2]), {"policy": [3, 2]})
    assert sampled_by(old).tolist() == [True, False]  # an older sender: its samples' policy


def test_the_tokens_a_sync_cut_off_from_their_replys_start_are_marked_and_no_others() -> None:
    # sample 0: a reply of 4 then 5 (a sync cut it), a turn's prompt, a reply all of 5 (a new request);
    # sample 1 begins right after sample 0's reply of 5 with one of 6 then 7; its second reply is bounded: unmarked
    v = np.array([-1, 4, 4, 5, 5, -1, -1, 5, 5, 6, 6, 7, -1, bounded(5), bounded(5)], np.int32)
    batch = Batch("r", 7, {"versions": v}, np.array([0, 9, 15]), {"policy": [4, 6], "policy_max": [7, 7]})
    assert np.flatnonzero(cut_by_sync(batch)).tolist() == [3, 4, 11]
    assert not cut_by_sync(Batch("r", 6, {"versions": v[:0]}, np.array([0]), {})).any()  # no tokens
    assert not cut_by_sync(Batch("r", 6, {"loss_mask": np.ones(3, np.uint8)}, np.array([0, 3]), {})).any()


def test_a_rollout_is_bounded_by_the_newest_sync_begun_on_its_server() -> None:
    server = Server(FakeInferenceServer("http://x/v1"))
    tracker = GroupTracker(max_off_policy_steps=4, group_timeout_s=60)
    group = Group("g", "e", 0, 3, 1, server, 0.0)
    tracker.open(group)
    server.ceiling = 5  # a sync to 5 began while it was in flight
    header = RolloutHeader(rid="g-0", group="g", env="e", task=0, policy_step=0, worker="w", server="s", ok=False,
                           failure=Failure.ENV)
    tracker.record(RolloutRecord(header, []))
    assert (header.policy_step, header.policy_max) == (3, 5)


def test_a_limit_that_can_never_mask_is_a_config_error(tmp_path: Path) -> None:
    path = write_job_toml(tmp_path, inference={"servers": ["http://127.0.0.1:9/v1"]},
                          scheduler={"batch_size": 8, "max_async_level": 1},
                          env=[{**ARITHMETIC, "max_token_lag": 1}])
    with pytest.raises(ConfigError, match=r"env\[0\]\.max_token_lag: 1 can never mask a token"):
        load_config(path)
    path = write_job_toml(tmp_path, inference={"servers": ["http://127.0.0.1:9/v1"]},
                          scheduler={"batch_size": 8, "max_async_level": 2}, env=[{**ARITHMETIC, "max_token_lag": 1}])
    assert load_config(path).env[0].max_token_lag == 1


def test_a_rollout_with_versions_is_masked_even_in_a_step_of_rollouts_without_them() -> None:
    """A step carries the versions column only when every rollout has it; a rollout that has it is still masked by its
    own versions, on both planes (the direct plane's reader reads the span's versions for that)."""
    from orchestrator.columns.store import ColumnStore
    from orchestrator.trainer.reader import PoolMaps

    b = builder(0)
    plain = rollout("plain", "synth-a", [((5, 2),)], 5)  # as an older worker sends it: no versions
    plain.header = msgspec.structs.replace(plain.header, optional=[], versions=[], frames=4)
    plain.frames = [plain.frames[i] for i in (0, 1, 2, 4)]
    plain.check()
    recs = [plain, rollout("mixed", "synth-a", [((4, 2), (5, 3))], 4)]
    through = b.assemble(STEP, [(r, 0.0) for r in recs])
    assert "versions" not in through.columns
    assert through.scalars["min_version"] == [None, 5]  # nothing to mask "plain" with
    assert through.sample(1)["loss_mask"].tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]

    store = ColumnStore(1 << 20)
    maps = PoolMaps(host="h")
    try:
        for r in recs:  # the same columns, in a worker's pool
            samples = [Sample(np.asarray(r.column("token_ids")), np.asarray(r.column("loss_mask")),
                              np.asarray(r.column("logprobs")), None,
                              np.asarray(r.column("versions")) if "versions" in r.header.optional else None)]
            r.header.span = store.put(r.rid, samples)
        maps.adopt(store.id, store.capacity, store.fd)
        pools = {"w": PoolInfo(id=store.id, size=store.capacity, host="h", path=None)}
        manifest = build_manifest("run", STEP, [(r, 0.0) for r in recs], pools, plan=lambda h: b.lag.keep(h, STEP))
        direct = maps.view(manifest).gather()
        assert "versions" not in direct.columns
        np.testing.assert_array_equal(direct.columns["loss_mask"], through.columns["loss_mask"])
        np.testing.assert_array_equal(direct.columns["token_ids"], through.columns["token_ids"])
        del direct
    finally:
        maps.close()
        store.close()
