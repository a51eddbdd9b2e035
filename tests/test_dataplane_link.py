"""Step manifests on the trainer link: the same delivery window as batches (order, acknowledgement), the trainer
library maps the workers' pools (announced ahead, or named by a manifest) and returns views or a gathered batch,
and an acknowledgement is what frees the columns. Real sockets; the pool is served in this process."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import numpy as np

from orchestrator.columns.memfd import serve_pool
from orchestrator.columns.store import ColumnStore
from orchestrator.contracts.manifest import StepManifest, build_manifest
from orchestrator.contracts.protocol import PoolInfo, RolloutRecord
from orchestrator.contracts.reports import LostStep
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.testing.procs import wait_until
from orchestrator.trainer.reader import StepView
from orchestrator.trainer.receiver import BatchReceiver, Received, SyncBatchReceiver

sys.path.insert(0, str(Path(__file__).parent))
from dataplane_peer import WORKER, peer_samples, record

WAIT_S = 60.0  # a hang guard: every wait below ends on a message


@contextlib.asynccontextmanager
async def link(tmp_path: Path) -> AsyncIterator[tuple[ColumnStore, PoolInfo, BatchSender]]:
    """A worker's pool served at its socket, and a trainer link (no trainer yet)."""
    store = ColumnStore(1 << 20)
    path = str(tmp_path / "w.pool")
    try:
        async with serve_pool(store, path), BatchSender.open(f"ipc://{tmp_path}/trainer.sock", 2, 30.0) as sender:
            yield store, PoolInfo(id=store.id, size=store.capacity, host=socket.gethostname(), path=path), sender
    finally:
        store.close()


def manifest(step: int, records: list[RolloutRecord], pool: PoolInfo) -> StepManifest:
    return build_manifest("run", step, [(r, 0.5 - i) for i, r in enumerate(records)], {WORKER: pool})


def check_columns(columns: dict[str, np.ndarray], rollout: int) -> None:
    want = peer_samples(rollout)
    for name in ("token_ids", "loss_mask", "logprobs", "routed_experts"):
        np.testing.assert_array_equal(columns[name], np.concatenate([getattr(s, name) for s in want]))


async def test_manifests_arrive_in_order_as_views_or_batches_and_acknowledgements_free_the_columns(
        tmp_path: Path) -> None:
    async with link(tmp_path) as (store, pool, sender):
        held: dict[int, list[str]] = {}

        def release(step: int) -> None:
            for s in sorted(held):
                if s <= step:
                    store.release(held.pop(s))

        sender.on_ack = release
        receiver = BatchReceiver(sender.address)
        try:
            first = [record(store, 0), record(store, 1)]
            held[0] = [r.rid for r in first]
            sent, view = await asyncio.wait_for(asyncio.gather(sender.send(manifest(0, first, pool)),
                                                               receiver.recv_view()), WAIT_S)
            assert sent
            assert isinstance(view, StepView)
            assert view.step == 0
            assert view.num_samples == 4  # two samples per rollout
            rows = view.sample(0)["token_ids"].size + view.sample(1)["token_ids"].size
            check_columns({k: np.concatenate([view.sample(i)[k] for i in (0, 1)]) for k in ("token_ids", "loss_mask",
                           "logprobs", "routed_experts")}, 0)
            assert rows == sum(s.num_tokens for s in peer_samples(0))
            assert sender.acked == -1  # a view is acknowledged by the next recv: the columns are still held
            assert store.live_bytes > 0

            second = [record(store, 2)]
            held[1] = [r.rid for r in second]
            _, batch = await asyncio.wait_for(asyncio.gather(sender.send(manifest(1, second, pool)),
                                                             receiver.recv()), WAIT_S)
            assert batch.step == 1
            check_columns(batch.columns, 2)  # gathered: the trainer's own copy, acknowledged at once
            await wait_until(lambda: sender.acked == 1, WAIT_S, "the acknowledgement of step 1", poll_s=0.01)
            assert store.live_bytes == 0  # every rollout of both steps released, on acknowledgement only
            assert receiver.pools.fetches == 1  # the pool was mapped once, for both steps
            assert not receiver.rejected
        finally:
            receiver.close()


async def test_a_pool_announced_before_the_trainer_came_is_mapped_before_a_step_names_it(tmp_path: Path) -> None:
    async with link(tmp_path) as (store, pool, sender):
        sender.announce_pool(WORKER, msgspec.structs.asdict(pool))
        receiver = BatchReceiver(sender.address)
        try:
            empty = manifest(0, [], pool)  # names no pool
            _, got = await asyncio.wait_for(asyncio.gather(sender.send(empty), receiver.recv_view()), WAIT_S)
            assert got.step == 0
            assert store.id in receiver.pools  # mapped from the announcement alone
        finally:
            receiver.close()


async def test_a_step_whose_pool_cannot_be_mapped_is_reported_lost_and_only_a_newer_attempt_is_accepted(
        tmp_path: Path) -> None:
    """Step 0 names a pool whose worker (and socket) died: the receiver returns nothing, reports step 0 lost
    and drops step 1 queued behind it; the rebuilt step 0 (attempt 1) replaces it, step 1 follows again."""
    async with link(tmp_path) as (store, pool, sender):
        gone = msgspec.structs.replace(pool, path=str(tmp_path / "gone.pool"))  # its worker (and socket) died
        receiver = BatchReceiver(sender.address)
        reports = sender.lost_steps()
        got: list[Received] = []

        async def trainer() -> None:
            while len(got) < 2:
                got.append(await receiver.recv_view())

        training = asyncio.create_task(trainer())
        try:
            lost_manifest = build_manifest("run", 0, [(record(store, 0), 0.5)], {WORKER: gone})
            await asyncio.wait_for(sender.send(lost_manifest), WAIT_S)
            lost = await asyncio.wait_for(anext(reports), WAIT_S)
            assert (lost.step, lost.attempt, lost.pools) == (0, 0, (store.id,))
            assert receiver.lost == 1
            assert not got  # no partial step
            assert not receiver.rejected  # lost is not corrupt
            await asyncio.wait_for(sender.send(manifest(1, [record(store, 1)], pool)), WAIT_S)  # dropped for now
            rebuilt = build_manifest("run", 0, [(record(store, 2), 0.5)], {WORKER: pool}, attempt=1)  # served again
            sender.replace(rebuilt)
            await asyncio.wait_for(training, WAIT_S)
            assert [(v.step, v.manifest.attempt) for v in got if isinstance(v, StepView)] == [(0, 1), (1, 0)]
            first = got[0]
            assert isinstance(first, StepView)
            check_columns({k: np.concatenate([first.sample(i)[k] for i in range(first.num_samples)])
                           for k in ("token_ids", "loss_mask", "logprobs", "routed_experts")}, 2)
            assert receiver.lost == 1
            assert receiver.last_step == 1
            assert not receiver.rejected  # the copy of step 1 sent while step 0 was lost was dropped, not refused
        finally:
            training.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await training
            receiver.close()


async def test_the_threaded_receiver_reads_manifests_too(tmp_path: Path) -> None:
    async with link(tmp_path) as (store, pool, sender):
        receiver = SyncBatchReceiver(sender.address)
        try:
            records = [record(store, 3)]
            _, view = await asyncio.wait_for(asyncio.gather(sender.send(manifest(0, records, pool)),
                                                            asyncio.to_thread(receiver.recv_view, WAIT_S)), WAIT_S)
            assert isinstance(view, StepView)
            check_columns({k: np.concatenate([view.sample(i)[k] for i in range(view.num_samples)])
                           for k in ("token_ids", "loss_mask", "logprobs", "routed_experts")}, 3)
            del view
            _, batch = await asyncio.wait_for(asyncio.gather(sender.send(manifest(1, [record(store, 4)], pool)),
                                                             asyncio.to_thread(receiver.recv, WAIT_S)), WAIT_S)
            check_columns(batch.columns, 4)
            await wait_until(lambda: sender.acked == 1, WAIT_S, "the acknowledgements", poll_s=0.01)
        finally:
            receiver.close()


async def test_the_threaded_receiver_reports_a_lost_step_too(tmp_path: Path) -> None:
    async with link(tmp_path) as (store, pool, sender):
        gone = msgspec.structs.replace(pool, path=str(tmp_path / "gone.pool"))  # its worker (and socket) died
        receiver = SyncBatchReceiver(sender.address)
        reports = sender.lost_steps()

        def trainer() -> list[tuple[int, int]]:
            views = [receiver.recv_view(WAIT_S) for _ in range(2)]
            return [(v.step, v.manifest.attempt) for v in views if isinstance(v, StepView)]

        async def orchestrator() -> LostStep:
            await sender.send(build_manifest("run", 0, [(record(store, 0), 0.5)], {WORKER: gone}))
            lost = await anext(reports)
            await sender.send(manifest(1, [record(store, 1)], pool))  # queued behind the lost step: dropped
            sender.replace(build_manifest("run", 0, [(record(store, 2), 0.5)], {WORKER: pool}, attempt=1))
            return lost

        try:
            got, lost = await asyncio.wait_for(asyncio.gather(asyncio.to_thread(trainer), orchestrator()), WAIT_S)
            assert (lost.step, lost.attempt) == (0, 0)
            assert got == [(0, 1), (1, 0)]
            assert receiver.lost == 1
            assert not receiver.rejected
        finally:
            receiver.close()


async def test_a_restarted_orchestrator_gets_the_lost_report_again_and_its_newer_attempt_is_accepted(
        tmp_path: Path) -> None:
    """The trainer reported step 0 (attempt 0) lost to an orchestrator that then died; the next one sends step 0
    as its own attempt 0, which the trainer drops as no newer than the one lost. The trainer's status messages
    repeat the report, so the new orchestrator rebuilds it as attempt 1, which the trainer takes."""
    store = ColumnStore(1 << 20)
    path = str(tmp_path / "w.pool")
    address = f"ipc://{tmp_path}/trainer.sock"
    pool = PoolInfo(id=store.id, size=store.capacity, host=socket.gethostname(), path=path)
    gone = msgspec.structs.replace(pool, path=str(tmp_path / "gone.pool"))
    receiver: BatchReceiver | None = None
    waiting: asyncio.Task[Received] | None = None
    try:
        async with serve_pool(store, path):
            async with BatchSender.open(address, 2, 30.0) as first:
                receiver = BatchReceiver(first.address)
                waiting = asyncio.create_task(receiver.recv_view())
                await asyncio.wait_for(first.send(build_manifest("run", 0, [(record(store, 0), 0.5)], {WORKER: gone})),
                                       WAIT_S)
                await asyncio.wait_for(anext(first.lost_steps()), WAIT_S)
            async with BatchSender.open(address, 2, 30.0, require_report=True) as second:
                await asyncio.wait_for(second.send(manifest(0, [record(store, 1)], pool)), WAIT_S)  # attempt 0
                lost = await asyncio.wait_for(anext(second.lost_steps()), WAIT_S)  # the report, repeated
                assert (lost.step, lost.attempt) == (0, 0)
                second.replace(build_manifest("run", 0, [(record(store, 2), 0.5)], {WORKER: pool}, attempt=1))
                view = await asyncio.wait_for(waiting, WAIT_S)
                assert isinstance(view, StepView)
                assert (view.step, view.manifest.attempt) == (0, 1)
                assert not receiver.rejected
    finally:
        if waiting is not None:
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await waiting
        if receiver is not None:
            receiver.close()
        store.close()
