"""Direct mode's read-back (dataplane/readback.py): the columns a step dump or the samples table needs, read from an
env worker's pool served on a Unix socket as the trainer reads it, as through-path records; a pool that cannot be
read leaves its records as they were and ends nothing."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from orchestrator.columns.memfd import serve_pool
from orchestrator.columns.store import ColumnStore
from orchestrator.contracts.protocol import PoolInfo, RolloutRecord
from orchestrator.dataplane.readback import Readback
from orchestrator.rollouts.groups import Group

sys.path.insert(0, str(Path(__file__).parent))
from dataplane_peer import WORKER, peer_samples, record


def group(gid: str, records: list[RolloutRecord]) -> Group:
    return Group(gid, "e", 0, 0, len(records), cast(Any, None), 0.0, records=records)


def assert_columns_of(rec: RolloutRecord, i: int) -> None:
    """``rec`` carries rollout ``i``'s columns as frames (the through path's record), and no span."""
    assert rec.header.span is None
    for name in rec.columns:
        want = np.concatenate([getattr(s, name) for s in peer_samples(i)])
        np.testing.assert_array_equal(rec.column(name).reshape(want.shape), want)


async def test_records_come_back_with_their_columns_and_a_limit_reads_one_per_group(tmp_path: Path) -> None:
    store = ColumnStore(1 << 20)
    async with serve_pool(store, str(tmp_path / "w.pool")) as path:
        groups = [group("g0", [record(store, 0), record(store, 1)]), group("g1", [record(store, 2)])]
        pools = {WORKER: PoolInfo(id=store.id, size=store.capacity, host=socket.gethostname(), path=path)}
        every = await asyncio.to_thread(Readback().groups, groups, pools)
        few = await asyncio.to_thread(Readback().groups, groups, pools, limit=1)
    store.close()
    for i, rec in enumerate(r for g in every for r in g.records):
        assert_columns_of(rec, i)
    assert [g.gid for g in every] == ["g0", "g1"]
    assert_columns_of(few[0].records[0], 0)  # the first survivor of the first group only
    assert [r.header.span is not None for g in few for r in g.records][1:] == [True, True]
    assert all(r.header.span is not None for g in groups for r in g.records)  # the originals are untouched


@pytest.mark.parametrize("gone", ["another pool id", "no socket"])
async def test_a_pool_that_cannot_be_read_leaves_its_records_and_raises_nothing(
        tmp_path: Path, gone: str, caplog: pytest.LogCaptureFixture) -> None:
    store = ColumnStore(1 << 20)
    groups = [group("g0", [record(store, 0)])]
    pool_id = "someone-else" if gone == "another pool id" else store.id
    pools = {WORKER: PoolInfo(id=pool_id, size=store.capacity, host=socket.gethostname(), path=str(tmp_path / "x"))}
    shown = await asyncio.to_thread(Readback().groups, groups, pools)
    store.close()
    assert shown[0].records[0] is groups[0].records[0]  # as it was: its span, no columns
    if gone == "no socket":
        assert "could not read the columns of 1 rollout(s)" in caplog.text
