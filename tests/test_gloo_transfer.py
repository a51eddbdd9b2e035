"""The gloo weight transfer's mechanics (``orchestrator.transfer.gloo``), with real gloo groups on loopback: the
packing plan, a broadcast to several receivers, and how it fails: a receiver whose plan differs, a sender that
goes away, one that stays silent, a rendezvous nobody serves.

Each rank runs in a thread of this process (a gloo group does not care which process its ranks are in); the
trainer is rank 0 and serves the rendezvous on a free port."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from orchestrator.transfer.gloo import (
    ALIGN,
    GlooGroup,
    GlooInitInfo,
    GlooUpdateInfo,
    TransferFailed,
    dtype_name,
    plan,
)

TIMEOUT_S = 20.0  # a rank that does not come is found out after this (the failure tests use 1 s)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(50, 16, generator=g),
            "layers.0.norm": torch.randn(16, generator=g).to(torch.bfloat16),
            "layers.0.big": torch.randn(300, 40, generator=g),  # 48,000 bytes: larger than the tests' buffer
            "layers.0.ids": torch.arange(7, dtype=torch.int64),
            "empty": torch.zeros(0, 3),
            "head.weight": torch.randn(16, 50, generator=g).to(torch.float16)}


def update_info(ts: dict[str, torch.Tensor]) -> GlooUpdateInfo:
    return GlooUpdateInfo(list(ts), [dtype_name(t.dtype) for t in ts.values()], [list(t.shape) for t in ts.values()])


class Ranks:
    """A trainer (rank 0) listening, and ``receivers`` worker threads joining it; ``errors`` per rank."""

    def __init__(self, receivers: int, timeout_s: float = TIMEOUT_S) -> None:
        self.trainer = GlooGroup.listen("127.0.0.1", 0, receivers + 1, timeout_s)
        self.infos = [GlooInitInfo("127.0.0.1", self.trainer.port, rank, receivers + 1, group="g", timeout_s=timeout_s)
                      for rank in range(1, receivers + 1)]
        self.workers: list[GlooGroup | None] = [None] * receivers
        self.errors: dict[int, BaseException] = {}
        threads = [self._thread(i + 1, functools.partial(self._connect, i)) for i in range(receivers)]
        self.trainer.join("g", "127.0.0.1")
        for t in threads:
            t.join(TIMEOUT_S)
        assert not self.errors, self.errors

    def _connect(self, i: int) -> None:
        self.workers[i] = GlooGroup.connect(self.infos[i], self.infos[i].rank_offset)

    def _thread(self, rank: int, fn: Callable[[], Any]) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except BaseException as e:
                self.errors[rank] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    def receive_all(self, info: GlooUpdateInfo, buffer_bytes: int, into: list[dict[str, torch.Tensor]]
                    ) -> list[threading.Thread]:
        def receive(i: int) -> None:
            group = self.workers[i]
            assert group is not None
            for pairs in group.receive(plan(info, buffer_bytes)):
                into[i].update((name, t.clone()) for name, t in pairs)

        return [self._thread(i + 1, functools.partial(receive, i)) for i in range(len(self.workers))]


def test_the_plan_packs_tensors_in_order_aligned_and_gives_a_large_one_a_chunk_of_its_own() -> None:
    chunks = plan(update_info(tensors()), 4096)
    slots = [s for c in chunks for s in c.slots]
    assert [s.name for s in slots] == list(tensors())
    assert all(s.offset % ALIGN == 0 for s in slots)
    assert all(c.nbytes <= 4096 or len(c.slots) == 1 for c in chunks)
    big = next(c for c in chunks if any(s.name == "layers.0.big" for s in c.slots))
    assert len(big.slots) == 1
    assert big.nbytes == 300 * 40 * 4
    for c in chunks:  # no two tensors of a chunk overlap
        ends = [(s.offset, s.offset + s.nbytes) for s in c.slots]
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))


def test_bad_init_and_update_info_are_value_errors_naming_the_field() -> None:
    with pytest.raises(ValueError, match="rank_offset"):
        GlooInitInfo("127.0.0.1", 1234, 0, 2)
    with pytest.raises(ValueError, match="unsupported dtype 'complex64'"):
        GlooUpdateInfo(["a"], ["complex64"], [[1]])
    with pytest.raises(ValueError, match="differ in length"):
        GlooUpdateInfo(["a", "b"], ["float32"], [[1]])


def test_a_broadcast_reaches_every_receiver_bit_for_bit_in_several_chunks() -> None:
    ranks = Ranks(2)
    ts = tensors()
    info = update_info(ts)
    assert len(plan(info, 4096)) >= 3
    got: list[dict[str, torch.Tensor]] = [{}, {}]
    threads = ranks.receive_all(info, 4096, got)
    ranks.trainer.send(ts.values(), plan(info, 4096), 4096)
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert not ranks.errors, ranks.errors
    for received in got:
        assert list(received) == list(ts)
        for name, t in ts.items():
            assert received[name].dtype == t.dtype, name
            assert torch.equal(received[name], t), name
    # a second update on the same group: the next step's weights
    ts2 = {k: v + 1 if v.dtype != torch.int64 else v for k, v in ts.items()}
    got2: list[dict[str, torch.Tensor]] = [{}, {}]
    threads = ranks.receive_all(info, 4096, got2)
    ranks.trainer.send(ts2.values(), plan(info, 4096), 4096)
    for thread in threads:
        thread.join(TIMEOUT_S)
    assert all(torch.equal(r["embed.weight"], ts2["embed.weight"]) for r in got2)


def test_a_receiver_whose_plan_differs_fails_at_once_naming_both_plans() -> None:
    """gloo would fill the larger buffer with the first smaller chunk and report success: the fingerprint
    broadcast first makes it an error."""
    ranks = Ranks(1, timeout_s=2.0)
    ts = tensors()
    info = update_info(ts)
    got: list[dict[str, torch.Tensor]] = [{}]
    threads = ranks.receive_all(info, 1 << 20, got)  # one chunk where the trainer sends several
    with pytest.raises(TransferFailed):  # nobody takes its chunks
        ranks.trainer.send(ts.values(), plan(info, 4096), 4096)
    threads[0].join(TIMEOUT_S)
    assert isinstance(ranks.errors[1], TransferFailed)
    assert "the trainer sends" in str(ranks.errors[1])
    assert "this worker expects 1" in str(ranks.errors[1])
    assert got == [{}]


def test_a_sender_that_goes_away_mid_update_fails_every_receiver_at_once() -> None:
    ranks = Ranks(2)
    info = update_info(tensors())
    got: list[dict[str, torch.Tensor]] = [{}, {}]
    t0 = time.monotonic()
    threads = ranks.receive_all(info, 4096, got)
    ranks.trainer.close()  # the trainer's process dies: its connections close
    for t in threads:
        t.join(TIMEOUT_S)
    assert time.monotonic() - t0 < TIMEOUT_S / 2  # "Connection closed by peer", not a timeout
    assert set(ranks.errors) == {1, 2}
    assert all(isinstance(e, TransferFailed) and "the broadcast of the plan failed" in str(e)
               for e in ranks.errors.values()), ranks.errors


def test_a_silent_sender_fails_the_receivers_after_the_timeout() -> None:
    ranks = Ranks(1, timeout_s=1.0)
    got: list[dict[str, torch.Tensor]] = [{}]
    t0 = time.monotonic()
    threads = ranks.receive_all(update_info(tensors()), 4096, got)
    threads[0].join(TIMEOUT_S)
    waited = time.monotonic() - t0
    assert isinstance(ranks.errors.get(1), TransferFailed)
    assert "Timed out" in str(ranks.errors[1])
    assert 0.9 <= waited < TIMEOUT_S
    ranks.trainer.close()


def test_a_rendezvous_nobody_serves_fails_after_the_timeout() -> None:
    trainer = GlooGroup.listen("127.0.0.1", 0, 3, 1.0)  # expects two workers; one comes
    port = trainer.port
    trainer.store = None  # type: ignore[assignment]  # the store goes: nobody serves the rendezvous
    del trainer
    with pytest.raises(TransferFailed, match=r"could not reach the rendezvous|did not form"):
        GlooGroup.connect(GlooInitInfo("127.0.0.1", port, 1, 3, timeout_s=1.0), 1)
