"""The step boundary in direct mode: a manifest from headers alone, rollouts of a pool gone since they were taken
fail instead of being named, and the survivors left out are returned for release."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from orchestrator.columns.layout import SpanLoc, shapes_layout
from orchestrator.config import FilterConfig
from orchestrator.contracts.manifest import decode_manifest, encode_manifest
from orchestrator.contracts.protocol import PoolInfo
from orchestrator.dataplane.manifests import ManifestBuilder
from orchestrator.rollouts.groups import lose_columns
from orchestrator.steps.boundary import StepBuilder
from orchestrator.steps.dump import ReplayGroup
from orchestrator.testing.steps import synthetic_config, synthetic_groups

POOLS = {"w1": PoolInfo(id="p1", size=1 << 24, host="h"), "w2": PoolInfo(id="p2", size=1 << 24, host="h")}


def direct_groups() -> list[ReplayGroup]:
    """Synthetic groups whose records carry spans instead of frames: even groups on w1 (pool p1, current),
    odd groups on w2 in pool p0 (w2 has renewed its pool to p2 since)."""
    groups = synthetic_groups(32, turns=2, tokens=64, layers=2, top_k=2, group_size=8)
    offset = 0
    for i, g in enumerate(groups):
        worker, pool = ("w1", "p1") if i % 2 == 0 else ("w2", "p0")
        for r in g.records:
            h = r.header
            nbytes = shapes_layout(h.samples, h.routed_dtype, h.optional).nbytes
            h.worker, h.span, h.frames = worker, SpanLoc(pool, offset, nbytes), 0
            r.frames = []
            offset += nbytes
    return groups


def test_a_manifest_names_only_rollouts_in_current_pools_and_returns_the_rest(
        caplog: pytest.LogCaptureFixture) -> None:
    groups = direct_groups()
    cfg = synthetic_config(32)
    builder = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, vocab_size=1 << 17)
    with caplog.at_level(logging.WARNING):
        result = ManifestBuilder(builder)(3, groups, (), POOLS)
    manifest = decode_manifest(encode_manifest(result.batch))  # a manifest the trainer's edge accepts
    assert manifest.step == 3
    assert [p.worker for p in manifest.pools] == ["w1"]
    named = {s.rollout for s in manifest.spans}
    assert named == {r.rid for r in result.trained}
    assert all(r.header.worker == "w1" for r in result.trained)
    lost = [r for g in groups[1::2] for r in g.records]
    assert all(r.header.failure == "worker_died" for r in lost)  # w2's columns are gone with pool p0
    assert {row.rollout for row in result.rows if row.failure == "worker_died"} == {r.rid for r in lost}
    survivors = {r.rid for g in groups for r in g.survivors}
    assert named.isdisjoint(r.rid for r in result.untrained)
    assert named | {r.rid for r in result.untrained} == survivors  # every survivor is trained or released
    assert result.num_samples == len(manifest.samples)
    assert not [r for r in caplog.records if "not applied" in r.getMessage()]  # the default filters all apply


def test_a_group_that_loses_some_columns_keeps_the_advantages_of_the_rest() -> None:
    group = direct_groups()[0]  # 8 rollouts on w1, pool p1
    for r in group.records[5:]:
        r.header.worker = "w9"  # three of them on another worker, whose pool goes
    # a dump's group has no advantages (the scheduler's Group does): given them here, as lose_columns reads any group
    group.advantages = np.arange(8, dtype=np.float64)  # type: ignore[attr-defined]
    assert lose_columns(group, "w9", "p1", "exited") == 3
    assert [r.ok for r in group.records] == [True] * 5 + [False] * 3
    np.testing.assert_array_equal(group.advantages, np.arange(5))  # type: ignore[attr-defined]
    assert lose_columns(group, "w9", "p1", "again") == 0  # failed records have no columns left to lose


def test_token_filters_use_the_workers_verdicts_and_custom_filters_are_named_not_run(
        caplog: pytest.LogCaptureFixture) -> None:
    base = synthetic_config(32)
    filters = (FilterConfig(name="zero_advantage", enforce=True), FilterConfig(name="gibberish", enforce=True),
               FilterConfig(name="repetition", enforce=False), FilterConfig(name="operator:truth", enforce=True))
    cfg = dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, filters=filters))
    groups = direct_groups()
    flagged = {g.records[0].rid: [1] for g in groups[::2]}  # the worker found these gibberish
    looping = {g.records[1].rid: [2] for g in groups[::2]}  # and these looping (monitor only)
    for g in groups:
        for r in g.records:
            r.header.filters = flagged.get(r.rid) or looping.get(r.rid) or []
    with caplog.at_level(logging.WARNING):
        builder = StepBuilder(cfg.pipeline, cfg.env, cfg.run.name, vocab_size=1 << 17)
        result = ManifestBuilder(builder)(0, groups, (), POOLS)
    named = {s.rollout for s in result.batch.spans}
    rows = {row.rollout: row for row in result.rows}
    for rid in flagged:
        assert rid not in named  # enforced
        assert "gibberish" in rows[rid].filters
    for rid in looping:
        assert "repetition" in rows[rid].filters
        assert rows[rid].filtered == ("zero_advantage" in rows[rid].filters)  # monitor only
    assert result.filter_counts["gibberish"] == {"synth-a": len(flagged)}  # even groups are synth-a
    skipped = [r for r in caplog.records if "not applied" in r.getMessage()]
    assert len(skipped) == 1  # named once, not run on a manifest
    assert "operator:truth" in skipped[0].getMessage()
