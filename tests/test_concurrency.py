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
         preemptions: int = 0, finished: int | None = None, capacity: int | None = None) -> ServerLoad:
    return ServerLoad(usage=usage, running=running, waiting=waiting, waiting_for_capacity=capacity_waiting,
                      preemptions=preemptions, engines=1, capacity_tokens=capacity, finished=finished)


def test_growth_accrues_per_completion_and_takes_at_most_a_group_a_poll() -> None:
    cap = ServerCap(CFG, ceiling=64, start=8, group=4)
    assert cap.observe(load(0.3), inflight=8, completed=0).rule is Rule.HOLD  # binds, nothing completed yet
    assert cap.observe(load(0.3), inflight=8, completed=4).rule is Rule.HOLD  # 8 x 1.25 ** (4 / 8) = 8.9
    grown = cap.observe(load(0.3), inflight=8, completed=8)  # and 8.9 x 1.25 ** (4 / 8) = 10: half a turnover
    assert (grown.rule, grown.cap) == (Rule.GROW, 10)  # each, no whole turnover needed
    wave = cap.observe(load(0.3), inflight=8, completed=40)  # four turnovers at once (x 2.4) ...
    assert (wave.rule, wave.cap) == (Rule.GROW, 14)  # ... but a group a poll


def test_growth_tapers_from_grow_below_to_none_at_trim_above() -> None:
    def after_a_turnover(usage: float) -> int:
        cap = ServerCap(CFG, ceiling=64, start=40, group=4)
        cap.observe(load(usage), inflight=40, completed=0)
        return cap.observe(load(usage), inflight=40, completed=40).cap

    assert after_a_turnover(0.3) == 44  # x 1.25 = 50, a group a poll
    assert after_a_turnover(0.7) == 44  # halfway: x 1.125 = 45
    assert after_a_turnover(0.78) == 41  # x 1.025
    assert after_a_turnover(0.8) == 40


def test_no_growth_when_the_cap_does_not_bind_or_a_capacity_queue_waits() -> None:
    cap = ServerCap(CFG, ceiling=64, start=8)
    assert cap.observe(load(0.3), inflight=5, completed=100).rule is Rule.HOLD  # the cap does not bind
    assert cap.observe(load(0.65, waiting=1), inflight=8, completed=200).rule is Rule.HOLD  # a queue, at 0.65
    assert cap.cap == 8
    # a request waiting in a clear cache arrived between two engine iterations: no reason not to grow
    assert cap.observe(load(0.3, waiting=1), inflight=8, completed=300).rule is Rule.GROW


def test_growth_stops_at_the_ceiling() -> None:
    cap = ServerCap(CFG, ceiling=9, start=8)
    cap.observe(load(0.1), inflight=8, completed=0)
    assert cap.observe(load(0.1), inflight=8, completed=8).cap == 9
    assert cap.observe(load(0.1), inflight=9, completed=100).rule is Rule.HOLD


def test_past_trim_above_the_cap_holds_and_is_not_lowered() -> None:
    """A reading past trim_above is often one wave's peak (a simulated job's usage swung 0.05-0.95 between polls
    at a steady cap): closing admission at what is in flight there held the cap a group low."""
    cap = ServerCap(CFG, ceiling=64, start=40)
    d = cap.observe(load(0.85), inflight=36, completed=0)
    assert (d.rule, d.cap, d.cancel) == (Rule.TRIM, 40, 0)
    assert cap.observe(load(0.85), inflight=40, completed=40).cap == 40  # no growth ...
    assert cap.observe(load(0.3), inflight=30, completed=80).cap == 40  # ... nor a cut


def test_a_cache_that_thrashes_poll_after_poll_is_hard_trimmed_one_wave_is_not() -> None:
    cfg = ConcurrencyConfig(adaptive=True, cancel_polls=3, preemption_budget=0)
    cap = ServerCap(cfg, ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=3), inflight=40, completed=0)  # the first poll only learns the counter
    assert cap.observe(load(0.95, preemptions=4), inflight=40, completed=0).cap == 36  # cut
    assert cap.observe(load(0.5, preemptions=4), inflight=36, completed=4).cancel == 0  # one wave's peak: over
    # then preempting at a full cache poll after poll, however far in flight drains:
    assert cap.observe(load(0.95, preemptions=5), inflight=36, completed=8).cap == 32
    assert cap.observe(load(0.95, preemptions=6), inflight=32, completed=12).cap == 32  # (36 at the last poll)
    d = cap.observe(load(0.95, preemptions=7), inflight=32, completed=16)  # the third poll in a row
    assert (d.rule, d.cap, d.cancel) == (Rule.CANCEL, 23, 9)  # floor(32 x 0.7 / 0.95) = 23


def test_a_full_cache_that_does_not_preempt_is_not_cancelled_unless_asked() -> None:
    """vLLM queues what does not fit: throwing work away helps only while it preempts."""
    cap = ServerCap(ConcurrencyConfig(adaptive=True, cancel_polls=1), ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=3), inflight=40, completed=0)
    d = cap.observe(load(0.95, preemptions=3), inflight=38, completed=0)
    assert (d.rule, d.cap, d.cancel) == (Rule.TRIM, 40, 0)
    always = ServerCap(ConcurrencyConfig(adaptive=True, cancel_only_preempting=False, cancel_polls=1), ceiling=64,
                       start=40)
    d = always.observe(load(0.95), inflight=40, completed=0)  # prime-rl's rule: at any full cache
    assert (d.rule, d.cap, d.cancel) == (Rule.CANCEL, 29, 11)


def test_without_a_request_counter_preemptions_cut_then_no_cut_until_in_flight_drains_to_it() -> None:
    cap = ServerCap(CFG, ceiling=64, start=40)
    cap.observe(load(0.5, preemptions=3), inflight=40, completed=0)  # the first poll only learns the counter
    d = cap.observe(load(0.5, preemptions=5), inflight=40, completed=0)
    assert (d.rule, d.cap) == (Rule.PREEMPTED, 36)  # floor(40 x 0.9)
    assert cap.observe(load(0.5, preemptions=9), inflight=38, completed=4).rule is Rule.HOLD  # draining
    assert cap.cap == 36
    cap.observe(load(0.5, preemptions=9), inflight=36, completed=10)  # drained: cuts are live again
    assert cap.observe(load(0.5, preemptions=10), inflight=36, completed=10).cap == 32


def test_preemptions_within_the_budget_stop_growth_and_past_it_cut() -> None:
    """0.0075 per finished request, a reserve of 600 requests' worth (4.5 preemptions)."""
    cap = ServerCap(CFG, ceiling=64, start=24, group=4)
    cap.observe(load(0.3, preemptions=0, finished=0), inflight=24, completed=0)
    held = cap.observe(load(0.5, preemptions=4, finished=100), inflight=24, completed=20)
    assert (held.rule, held.cap) == (Rule.HOLD, 24)  # 4 of the reserve's 4.5 (+ 0.75 earned): no cut ...
    assert cap.observe(load(0.3, preemptions=4, finished=200), inflight=24, completed=60).cap == 24  # ... and
    # no growth past the 24 they happened under (until probe_after turnovers pass without another)
    cut = cap.observe(load(0.5, preemptions=7, finished=300), inflight=24, completed=70)  # 7 > 4.5 + 2.25
    assert (cut.rule, cut.cap) == (Rule.PREEMPTED, 21)
    # while over the budget growth stays below the 24 that preempted (a group in flight fewer) ...
    assert cap.observe(load(0.3, preemptions=7, finished=400), inflight=20, completed=100).cap == 23
    # ... and once it is repaid (2.25 owed: 300 requests) may reach it again
    assert cap.observe(load(0.3, preemptions=7, finished=720), inflight=20, completed=130).cap == 24


def test_quiet_turnovers_let_growth_probe_a_group_past_the_limit_and_a_failed_probe_waits_twice_as_long() -> None:
    cfg = ConcurrencyConfig(adaptive=True, probe_after=2)
    cap = ServerCap(cfg, ceiling=64, start=24, group=4)
    cap.observe(load(0.3, preemptions=0, finished=0), inflight=24, completed=0)
    cap.observe(load(0.3, preemptions=1, finished=10), inflight=24, completed=0)  # within the budget: limit 24
    assert cap.observe(load(0.3, preemptions=1, finished=50), inflight=24, completed=47).cap == 24  # < 2 turnovers
    assert cap.observe(load(0.3, preemptions=1, finished=60), inflight=24, completed=72).cap == 28  # a probe
    cap.observe(load(0.3, preemptions=2, finished=70), inflight=28, completed=75)  # it preempted: limit 28 ...
    assert cap.observe(load(0.3, preemptions=2, finished=90), inflight=28, completed=75 + 3 * 28).cap == 28
    # ... and the next probe waits 4 turnovers
    assert cap.observe(load(0.3, preemptions=2, finished=99), inflight=28, completed=75 + 4 * 28).cap == 32


def test_preemptions_seen_while_draining_are_blamed_on_the_load_before_it() -> None:
    # 32 in flight at one poll, 20 at the next, and a preemption between: it happened under the 32 (a sim run
    # blamed the 20 and held the cap a group below it for the rest of the job)
    cap = ServerCap(CFG, ceiling=64, start=32)
    cap.observe(load(0.5, preemptions=0), inflight=32, completed=0)
    cut = cap.observe(load(0.5, preemptions=1), inflight=20, completed=12)
    assert (cut.rule, cut.cap) == (Rule.PREEMPTED, 28)  # floor(32 x 0.9), not floor(20 x 0.9) = 18
    assert cap.observe(load(0.2, preemptions=1), inflight=28, completed=40).cap == 29  # grows on, to 32 at most


def test_a_queue_cuts_only_when_it_persists() -> None:
    cap = ServerCap(CFG, ceiling=64, start=20)
    busy = 0.7  # over grow_below, under trim_above: only the queue rule can act
    assert cap.observe(load(busy, waiting=4, capacity_waiting=3), inflight=20, completed=0).rule is Rule.HOLD
    assert cap.observe(load(busy, waiting=4, capacity_waiting=0), inflight=20, completed=0).rule is Rule.HOLD
    assert cap.observe(load(busy, waiting=2, capacity_waiting=2), inflight=20, completed=0).rule is Rule.HOLD
    d = cap.observe(load(busy, waiting=2, capacity_waiting=2), inflight=20, completed=0)
    assert (d.rule, d.cap) == (Rule.QUEUED, 18)


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
    cap = ServerCap(cfg, ceiling=64, start=4)
    cap.observe(load(0.5, preemptions=1), inflight=4, completed=0)
    assert cap.observe(load(0.5, preemptions=2), inflight=4, completed=0).cap == 4  # not floor(4 x 0.9) = 3
    cap = ServerCap(cfg, ceiling=64, start=1)
    assert cap.cap == 4


def test_the_first_cap_is_the_kv_capacity_over_a_rollouts_length() -> None:
    cap = ServerCap(CFG, ceiling=64, start=64, group=4, from_capacity=True)
    assert cap.cap == 4  # one group before the first poll: an idle server takes one anyway
    assert cap.observe(load(0.1, capacity=8192), inflight=4, completed=0, rollout_tokens=None).cap == 4
    start = cap.observe(load(0.1, capacity=8192), inflight=4, completed=4, rollout_tokens=460)
    assert (start.rule, start.cap) == (Rule.START, 17)  # 8192 // 460: all of them at their longest fit
    silent = ServerCap(CFG, ceiling=64, start=32, group=4, from_capacity=True)
    assert silent.observe(load(0.1), inflight=4, completed=0).cap == 32  # no capacity said: the set start


def test_a_server_without_kv_capacity_at_all_is_capped_by_its_floor_not_zero() -> None:
    cap = ServerCap(CFG, ceiling=64, start=64, group=4, from_capacity=True)
    assert cap.observe(load(0.1, capacity=1024), inflight=4, completed=4, rollout_tokens=4096).cap == 1


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


def test_a_cap_binds_when_another_group_does_not_fit() -> None:
    """In flight moves in whole groups: 16 of a cap of 21 with groups of 8 is as full as it gets."""
    cap = ServerCap(CFG, ceiling=64, start=21, group=8)
    cap.observe(load(0.3), inflight=16, completed=0)
    grown = cap.observe(load(0.3), inflight=16, completed=16)
    assert (grown.rule, grown.cap) == (Rule.GROW, 26)  # 21 x 1.25
    assert cap.observe(load(0.3), inflight=8, completed=100).rule is Rule.HOLD  # room for two more groups
