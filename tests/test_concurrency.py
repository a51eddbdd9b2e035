"""The per-server concurrency cap (rollouts/concurrency.py), rule by rule, on made-up loads, and which groups a hard
trim cancels (rollouts/groups.py): pure, no I/O."""

from __future__ import annotations

import pytest

from orchestrator.errors import Failure
from orchestrator.inference.load import ServerLoad
from orchestrator.inference.pool import Server
from orchestrator.rollouts.concurrency import Rule, ServerCap
from orchestrator.rollouts.config import ConcurrencyConfig
from orchestrator.rollouts.groups import Group, GroupTracker
from orchestrator.testing.fake_server import FakeInferenceServer

CFG = ConcurrencyConfig(adaptive=True)


def load(usage: float, *, running: int = 0, waiting: int = 0, capacity_waiting: int | None = None,
         preemptions: int = 0) -> ServerLoad:
    return ServerLoad(usage=usage, running=running, waiting=waiting, waiting_for_capacity=capacity_waiting,
                      preemptions=preemptions, engines=1)


def test_a_binding_cap_grows_once_per_turnover_while_the_cache_is_clear() -> None:
    cap = ServerCap(CFG, ceiling=64, start=8)
    assert cap.observe(load(0.3), inflight=8, completed=0).rule is Rule.HOLD  # binds, but nothing turned over
    grown = cap.observe(load(0.3), inflight=8, completed=8)
    assert (grown.rule, grown.cap) == (Rule.GROW, 10)  # ceil(8 x 1.25)
    assert cap.observe(load(0.3), inflight=10, completed=12).rule is Rule.HOLD  # 4 < 10 completions since
    assert cap.observe(load(0.3), inflight=10, completed=18).cap == 13


def test_no_growth_when_the_cap_does_not_bind_or_requests_wait_or_the_cache_is_busy() -> None:
    cap = ServerCap(CFG, ceiling=64, start=8)
    assert cap.observe(load(0.3), inflight=5, completed=100).rule is Rule.HOLD  # the cap does not bind
    assert cap.observe(load(0.3, waiting=1), inflight=8, completed=200).rule is Rule.HOLD
    assert cap.observe(load(0.65), inflight=8, completed=300).rule is Rule.HOLD  # between grow_below and trim
    assert cap.cap == 8


def test_growth_stops_at_the_ceiling() -> None:
    cap = ServerCap(CFG, ceiling=9, start=8)
    assert cap.observe(load(0.1), inflight=8, completed=8).cap == 9
    assert cap.observe(load(0.1), inflight=9, completed=100).rule is Rule.HOLD


def test_soft_trim_closes_admission_at_what_is_in_flight_and_cancels_nothing() -> None:
    """Not trimmed to trim_to: a reading past trim_above is often the peak of rollouts about to finish (a simulated
    job's usage swung 0.05-0.95 between polls at a steady cap), and sizing the cap from it cut a group each time."""
    cap = ServerCap(CFG, ceiling=64, start=40)
    d = cap.observe(load(0.85), inflight=36, completed=0)
    assert (d.rule, d.cap, d.cancel) == (Rule.TRIM, 36, 0)
    assert cap.observe(load(0.85), inflight=38, completed=0).cap == 36  # never raised
    assert cap.observe(load(0.3), inflight=30, completed=0).cap == 36  # nor lowered by completions


def test_hard_trim_cancels_the_excess_over_what_the_cache_holds() -> None:
    cap = ServerCap(CFG, ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=3), inflight=40, completed=0)  # the first poll only learns the counter
    d = cap.observe(load(0.95, preemptions=4), inflight=40, completed=0)
    assert (d.rule, d.cap, d.cancel) == (Rule.CANCEL, 29, 11)  # floor(40 x 0.7 / 0.95) = 29


def test_a_full_cache_that_does_not_preempt_is_trimmed_not_cancelled_unless_asked() -> None:
    """vLLM queues what does not fit: throwing work away helps only while it preempts."""
    cap = ServerCap(CFG, ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=3), inflight=40, completed=0)
    d = cap.observe(load(0.95, preemptions=3), inflight=38, completed=0)
    assert (d.rule, d.cap, d.cancel) == (Rule.TRIM, 38, 0)
    always = ServerCap(ConcurrencyConfig(adaptive=True, cancel_only_preempting=False), ceiling=64, start=40)
    d = always.observe(load(0.95), inflight=40, completed=0)  # prime-rl's rule: at any full cache
    assert (d.rule, d.cap, d.cancel) == (Rule.CANCEL, 29, 11)


def test_preemptions_cut_the_cap_then_no_cut_until_in_flight_drains_to_it() -> None:
    cap = ServerCap(CFG, ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=3), inflight=40, completed=0)  # the first poll only learns the counter
    d = cap.observe(load(0.5, preemptions=5), inflight=40, completed=0)
    assert (d.rule, d.cap) == (Rule.PREEMPTED, 30)  # floor(40 x 0.75)
    assert cap.observe(load(0.5, preemptions=9), inflight=36, completed=4).rule is Rule.HOLD  # draining
    assert cap.cap == 30
    cap.observe(load(0.5, preemptions=9), inflight=30, completed=10)  # drained: cuts are live again
    assert cap.observe(load(0.5, preemptions=10), inflight=30, completed=10).cap == 22


def test_a_queue_cuts_only_when_it_persists() -> None:
    cap = ServerCap(CFG, ceiling=64, start=20)
    busy = 0.7  # over grow_below, under trim_above: only the queue rule can act
    assert cap.observe(load(busy, waiting=4, capacity_waiting=3), inflight=20, completed=0).rule is Rule.HOLD
    assert cap.observe(load(busy, waiting=4, capacity_waiting=0), inflight=20, completed=0).rule is Rule.HOLD
    assert cap.observe(load(busy, waiting=2, capacity_waiting=2), inflight=20, completed=0).rule is Rule.HOLD
    d = cap.observe(load(busy, waiting=2, capacity_waiting=2), inflight=20, completed=0)
    assert (d.rule, d.cap) == (Rule.QUEUED, 15)


def test_without_a_breakdown_by_reason_every_waiting_request_counts() -> None:
    cap = ServerCap(CFG, ceiling=64, start=20)
    cap.observe(load(0.7, waiting=1), inflight=20, completed=0)
    assert cap.observe(load(0.7, waiting=1), inflight=20, completed=0).rule is Rule.QUEUED


@pytest.mark.parametrize(("usage", "running", "waiting"), [
    (0.05, 1, 3),  # a clear cache: requests that arrived between two engine iterations (seen at usage 0.01-0.16
                   # in a simulated job, cutting its cap a group at a time)
    (0.7, 12, 6),  # a busy cache, but no more waiting than queue_ratio (0.5) x running
])
def test_waiting_requests_are_not_a_capacity_queue_unless_the_cache_is_busy_and_they_are_many(
        usage: float, running: int, waiting: int) -> None:
    cap = ServerCap(CFG, ceiling=64, start=20)
    for _ in range(3 * CFG.queue_polls):
        assert cap.observe(load(usage, running=running, waiting=waiting), inflight=20, completed=0).rule is Rule.HOLD
    d = cap.observe(load(0.7, running=running, waiting=waiting + 1), inflight=20, completed=0)
    assert d.rule is Rule.HOLD  # the first poll of a queue that counts
    assert cap.observe(load(0.7, running=running, waiting=running), inflight=20, completed=0).rule is Rule.QUEUED


def test_an_unreadable_server_keeps_the_static_cap_and_relearns_its_counter() -> None:
    cap = ServerCap(CFG, ceiling=64, start=20)
    cap.observe(load(0.5, preemptions=3), inflight=20, completed=0)
    assert cap.observe(None, inflight=20, completed=0) == cap.last
    assert (cap.last.rule, cap.cap) == (Rule.UNREADABLE, 64)
    # a restarted server's counter starts again: no cut for a drop, and none for the first poll after
    assert cap.observe(load(0.5, preemptions=1), inflight=20, completed=0).rule is Rule.HOLD


def test_no_cut_goes_below_the_floor() -> None:
    cfg = ConcurrencyConfig(adaptive=True, min_per_server=4)
    cap = ServerCap(cfg, ceiling=64, start=5)
    cap.observe(load(0.5, preemptions=1), inflight=5, completed=0)
    assert cap.observe(load(0.5, preemptions=2), inflight=5, completed=0).cap == 4  # not floor(5 x 0.75) = 3
    cap = ServerCap(cfg, ceiling=64, start=1)
    assert cap.cap == 4


@pytest.mark.parametrize(("cfg", "key"), [(ConcurrencyConfig(grow_below=0.85), "grow_below"),
                                          (ConcurrencyConfig(trim_to=0.9), "trim_to"),
                                          (ConcurrencyConfig(cancel_above=0.75), "cancel_above")])
def test_thresholds_out_of_order_are_named(cfg: ConcurrencyConfig, key: str) -> None:
    problems = list(cfg.problems("scheduler.concurrency", lambda key: "job.toml"))
    assert problems
    assert all("scheduler.concurrency." in p for p in problems)
    assert any(key in p for p in problems)
    assert list(ConcurrencyConfig().problems("scheduler.concurrency", lambda key: "job.toml")) == []


def test_shedding_cancels_whole_groups_not_yet_half_done_youngest_first_never_the_oldest() -> None:
    here = Server(FakeInferenceServer("http://a.invalid/v1"))
    there = Server(FakeInferenceServer("http://b.invalid/v1"))
    tracker = GroupTracker(max_off_policy_steps=2, group_timeout_s=600)
    groups = {name: Group(name, "env", 0, 0, 4, server, started) for name, server, started in
              [("old", here, 1.0), ("mid", here, 2.0), ("young", here, 3.0), ("half", here, 4.0),
               ("elsewhere", there, 5.0)]}
    for g in groups.values():
        tracker.open(g)
    for rid in groups["half"].rids[:2]:  # half done: let it finish
        tracker.fail(groups["half"], rid, Failure.ENV, "x")
    tracker.fail(groups["mid"], groups["mid"].rids[0], Failure.ENV, "x")  # a quarter done: may go
    shed = tracker.shed(here.url, 5, "KV usage 0.95")
    assert [(e.group.gid, e.kind) for e in shed] == [("young", Failure.KV_PRESSURE), ("mid", Failure.KV_PRESSURE)]
    assert tracker.counts["cancelled"] == 4 + 3
    assert tracker.shed(there.url, 0, "nothing asked") == []
    assert [e.group.gid for e in tracker.shed(here.url, 100, "all")] == ["young", "mid"]  # the oldest runs on
    assert tracker.shed(there.url, 100, "its only group") == []


def test_a_hard_trim_cancels_once_then_only_trims_until_drained() -> None:
    cap = ServerCap(CFG, ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=1), inflight=40, completed=0)
    assert cap.observe(load(0.95, preemptions=2), inflight=40, completed=0).cancel == 11
    again = cap.observe(load(0.97, preemptions=3), inflight=36, completed=0)  # the cancelled are still leaving
    assert (again.rule, again.cap, again.cancel) == (Rule.TRIM, 29, 0)
    cap.observe(load(0.5, preemptions=3), inflight=29, completed=11)  # drained to the cap
    assert cap.observe(load(0.95, preemptions=4), inflight=29, completed=11).rule is Rule.CANCEL


def test_a_cap_binds_when_another_group_does_not_fit() -> None:
    """In flight moves in whole groups: 16 of a cap of 21 with groups of 8 is as full as it gets."""
    cap = ServerCap(CFG, ceiling=64, start=21, group=8)
    grown = cap.observe(load(0.3), inflight=16, completed=21)
    assert (grown.rule, grown.cap) == (Rule.GROW, 27)  # ceil(21 x 1.25)
    assert cap.observe(load(0.3), inflight=8, completed=100).rule is Rule.HOLD  # room for three more groups


def test_after_a_cut_on_preemptions_growth_stays_below_what_preempted_then_probes_it() -> None:
    cfg = ConcurrencyConfig(adaptive=True, probe_after=2)
    cap = ServerCap(cfg, ceiling=64, start=8)
    cap.observe(load(0.3, preemptions=0), inflight=8, completed=0)
    assert cap.observe(load(0.5, preemptions=1), inflight=8, completed=0).cap == 6  # cut: 8 in flight preempted
    assert cap.observe(load(0.2, preemptions=1), inflight=6, completed=6).cap == 7  # grows, but below 8 ...
    assert cap.observe(load(0.2, preemptions=1), inflight=7, completed=13).rule is Rule.HOLD  # ... and stays there
    assert cap.observe(load(0.2, preemptions=1), inflight=7, completed=14).cap == 8  # 2 turnovers: probes 8
    assert cap.observe(load(0.5, preemptions=2), inflight=8, completed=14).cap == 6  # it preempted: cut again,
    cap.observe(load(0.2, preemptions=2), inflight=6, completed=20)
    assert cap.cap == 7
    assert cap.observe(load(0.2, preemptions=2), inflight=7, completed=41).rule is Rule.HOLD  # and 4 to wait now
    assert cap.observe(load(0.2, preemptions=2), inflight=7, completed=42).cap == 8
    assert cap.observe(load(0.2, preemptions=2), inflight=8, completed=78).cap == 10  # held 8 turnovers: past it
    at_once = ServerCap(ConcurrencyConfig(adaptive=True, probe_after=0), ceiling=64, start=8)
    at_once.observe(load(0.3), inflight=8, completed=0)
    at_once.observe(load(0.5, preemptions=1), inflight=8, completed=0)
    assert at_once.observe(load(0.2, preemptions=1), inflight=6, completed=6).cap == 8  # prime-rl's: straight back


def test_preemptions_seen_while_draining_are_blamed_on_the_load_before_it() -> None:
    # 32 in flight at one poll, 20 at the next, and a preemption between: it happened under the 32 (a sim run
    # blamed the 20 and held the cap a group below it for the rest of the job)
    cap = ServerCap(ConcurrencyConfig(adaptive=True, probe_after=2), ceiling=64, start=32)
    cap.observe(load(0.5, preemptions=0), inflight=32, completed=0)
    cut = cap.observe(load(0.5, preemptions=1), inflight=20, completed=12)
    assert (cut.rule, cut.cap) == (Rule.PREEMPTED, 24)  # floor(32 x 0.75), not floor(20 x 0.75) = 15
    assert cap.observe(load(0.2, preemptions=1), inflight=24, completed=36).cap == 30  # below 32, not below 20
