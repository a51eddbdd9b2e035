"""The trainer library's side of the data plane on one node: a manifest in, read-only views of worker pools out.

The worker runs in its own process (``tests/dataplane_peer.py``) where a test can kill it; an in-process store
covers adopting an fd and the zero-copy check. Nothing may ever appear in /dev/shm.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.columns.store import ColumnStore
from orchestrator.contracts.manifest import StepManifest, build_manifest, decode_manifest
from orchestrator.contracts.protocol import PoolInfo
from orchestrator.errors import WireError
from orchestrator.trainer.packing import pack
from orchestrator.trainer.reader import PoolMaps, PoolsLost, StepView

sys.path.insert(0, str(Path(__file__).parent))
from dataplane_peer import WORKER, peer_samples, record
from shm_peer import dev_shm, left_in_dev_shm

PEER = Path(__file__).parent / "dataplane_peer.py"
HANG_GUARD_S = 120.0  # a peer starts in well under a second on a quiet machine, many times that on a busy one
MEMFD = "/memfd:orchestrator-columns"
pytestmark = pytest.mark.timeout(300)


def memfd_maps() -> int:
    return sum(MEMFD in line for line in Path("/proc/self/maps").read_text().splitlines())


def assert_matches_peer(view: StepView, rollouts: int) -> None:
    """Every sample's columns are exactly what the peer wrote, in manifest order, and read-only."""
    i = 0
    for r in range(rollouts):
        for want in peer_samples(r):
            got = view.sample(i)
            assert got["rollout"] == f"r{r}"
            assert got["advantage"] == 0.5 - r
            for name in ("token_ids", "loss_mask", "logprobs", "routed_experts"):
                col = got[name]
                assert not col.flags.writeable, name
                assert col.dtype == getattr(want, name).dtype, name
                np.testing.assert_array_equal(col, getattr(want, name))
            i += 1
    assert i == view.num_samples


class Peer:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        async with asyncio.timeout(HANG_GUARD_S):
            raw = await self.proc.stdout.readline()
        assert raw, f"peer {self.proc.pid} ended (exit {await self.proc.wait()}) before printing"
        out: dict[str, Any] = json.loads(raw)
        return out

    async def say(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    async def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()


@contextlib.asynccontextmanager
async def worker_peer(path: Path, rollouts: int) -> AsyncIterator[tuple[Peer, StepManifest]]:
    """A dataplane_peer.py process serving its pool at ``path``, and the manifest of its rollouts. Killed by
    its pid on exit if still running."""
    proc = await asyncio.create_subprocess_exec(sys.executable, str(PEER), str(path), "--rollouts", str(rollouts),
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    try:
        peer = Peer(proc)
        yield peer, decode_manifest(bytes.fromhex((await peer.line())["manifest"]))
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


async def test_a_trainer_views_a_workers_columns_without_a_copy_and_they_outlive_the_worker(tmp_path: Path) -> None:
    before = dev_shm()
    maps = PoolMaps()
    async with worker_peer(tmp_path / "w.pool", rollouts=5) as (peer, manifest):
        view = await asyncio.to_thread(maps.view, manifest)  # fetching the fd blocks, briefly
        assert maps.fetches == 1
        assert memfd_maps() == 1
        assert_matches_peer(view, 5)
        again = await asyncio.to_thread(maps.view, manifest)  # mapped once, viewed as often as needed
        assert maps.fetches == 1
        assert_matches_peer(again, 5)
        await peer.say("release r0,r1,r9")  # r9 was never stored: releases are by rollout id, idempotent
        assert await peer.line() == {"released": 2, "live": span_bytes(manifest, {"r2", "r3", "r4"})}
        await peer.kill()
    assert_matches_peer(view, 5)  # the worker is gone; the mapping, and so every view, stays valid
    assert await left_in_dev_shm(before) == set()
    maps.close()
    del view, again
    gc.collect()
    assert memfd_maps() == 0  # the last views went: unmapped, and with no process left the kernel frees it


def span_bytes(manifest: StepManifest, rollouts: set[str]) -> int:
    """The bytes the spans of ``rollouts`` take in their pool."""
    return sum(s.layout().nbytes
               for s in manifest.spans if s.rollout in rollouts)


async def test_gather_makes_the_through_paths_batch_and_packs(tmp_path: Path) -> None:
    maps = PoolMaps()
    try:
        async with worker_peer(tmp_path / "w.pool", rollouts=3) as (_peer, manifest):
            view = await asyncio.to_thread(maps.view, manifest)
            batch = view.gather()
            assert batch.step == 0
            assert batch.num_samples == 6
            assert list(batch.columns) == ["token_ids", "loss_mask", "logprobs", "routed_experts"]
            wanted = [s for r in range(3) for s in peer_samples(r)]
            for i, want in enumerate(wanted):
                got = batch.sample(i)
                np.testing.assert_array_equal(got["routed_experts"], want.routed_experts)
                np.testing.assert_array_equal(got["token_ids"], want.token_ids)
            assert batch.columns["token_ids"].flags.writeable  # a copy: the trainer may keep it past the ack
            packing = pack(batch, seq_len=128, dp=2)
            assert sum(len(mb.samples) for r in packing.ranks for mb in r.micro_batches) == 6
    finally:
        maps.close()


def test_an_adopted_fd_is_viewed_in_place() -> None:
    store = ColumnStore(1 << 20)
    maps = PoolMaps(host="here")
    try:
        trained = [(record(store, i), 1.0) for i in range(3)]
        info = PoolInfo(id=store.id, size=store.capacity, host="here", path=None)
        manifest = build_manifest("run", 4, trained, {WORKER: info})
        maps.adopt(store.id, store.capacity, store.fd)
        view = maps.view(manifest)
        assert_matches_peer_values(view)
        base = np.frombuffer(maps._pools[store.id].view, np.uint8).ctypes.data
        for i in range(view.num_samples):
            for name, col in view.sample(i).items():
                if isinstance(col, np.ndarray):  # inside the one mapping: a view, not a copy
                    assert base <= col.ctypes.data < base + store.capacity, name
        with pytest.raises(WireError, match="not a sealed"):
            maps.adopt("other", store.capacity + 64, store.fd)
    finally:
        maps.close()
        store.close()


def assert_matches_peer_values(view: StepView) -> None:
    for i in range(view.num_samples):
        r, j = divmod(i, 2)
        np.testing.assert_array_equal(view.sample(i)["logprobs"], peer_samples(r)[j].logprobs)


def test_a_pool_on_another_host_or_without_a_socket_is_named() -> None:
    store = ColumnStore(1 << 16)
    try:
        trained = [(record(store, 0), 1.0)]
        for info in (PoolInfo(id=store.id, size=store.capacity, host="node-b", path="/run/x/w.pool"),
                     PoolInfo(id=store.id, size=store.capacity, host="here", path=None)):
            manifest = build_manifest("run", 0, trained, {WORKER: info})
            with pytest.raises(PoolsLost, match="names no span server, or names no socket"):
                PoolMaps(host="here").view(manifest)
    finally:
        store.close()


async def test_a_worker_that_renews_its_pool_is_mapped_again_and_the_old_mapping_goes(tmp_path: Path) -> None:
    maps = PoolMaps()
    try:
        async with worker_peer(tmp_path / "w.pool", rollouts=2) as (peer, first):
            old = await asyncio.to_thread(maps.view, first)
            await peer.kill()
        async with worker_peer(tmp_path / "w.pool", rollouts=2) as (_peer, second):  # same worker, new pool
            assert second.pools[0].id != first.pools[0].id
            new = await asyncio.to_thread(maps.view, second)
            assert maps.fetches == 2
            assert first.pools[0].id not in maps
            assert_matches_peer(new, 2)
            assert_matches_peer(old, 2)  # dropped by the maps, still mapped while its views live
            del old
            gc.collect()
            assert memfd_maps() == 1
    finally:
        maps.close()


@pytest.mark.parametrize("first", ["orchestrator.trainer.reader", "orchestrator.columns.store",
                                   "orchestrator.trainer.receiver", "orchestrator.columns.memfd"])
def test_the_trainer_library_imports_in_any_order(first: str) -> None:
    """The receiver imports the reader, and the reader uses transport's memfd and wire: whichever a trainer
    imports first, in a fresh interpreter, the import works (no module needs another loaded before it)."""
    import subprocess

    code = f"import {first}; from orchestrator.transport import BatchReceiver; from orchestrator.trainer.reader " \
           "import PoolMaps"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, check=False)
    assert done.returncode == 0, done.stderr
