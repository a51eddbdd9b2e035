"""How many rollouts each inference server may run at once, following its KV cache (``[scheduler.concurrency]``).

A static ``max_inflight`` is wrong in both directions on a real fleet: too low and the engines idle; too high and
the KV cache fills, vLLM preempts and recomputes, and throughput collapses, worst for long multi-turn rollouts
whose contexts grow in place. ``ServerCap`` is one server's cap, moved by what its ``/metrics`` say
(inference/load.py) at each poll. Pure: no I/O, no clock; the poller feeds it and the admission stage obeys it.

The rules, in order, each with its setting (the thresholds' defaults are prime-rl's controller's at 559b447, module
constants there; the budget, the probes and the start are ours, tuned on a virtual-time job of the simulator's
KV model over machines of different speed: testing/kvjob.py, tests/test_concurrency_speeds.py):

0. **Start** (``start_per_server`` unset): one group until the server's first readable poll says its KV capacity
   (``vllm:cache_config_info``) and a rollout's length is known (``rollout_tokens``, else the longest rollout of
   the first groups to finish there), then capacity / length: as many rollouts as fit at their longest at once,
   a cap that should not preempt (prime-rl starts at capacity / max_model_len). A server that does not say its
   capacity starts at ``start_per_server`` or the ceiling split over the servers.
1. **Hard** (KV usage above ``cancel_above`` while the server preempts, ``cancel_polls`` polls in a row: a cache
   that thrashes, not one wave's peak): the cap becomes what would hold the cache at ``trim_to`` (in flight x
   ``trim_to`` / usage), and the rollouts above it are cancelled (whole groups not yet half done, youngest first,
   never a server's oldest group: groups.py ``shed``). Then nothing more is cancelled or cut until the in-flight
   count has drained to the cap. A full cache that does not preempt only queues (vLLM admits a request when its
   blocks are free), so it is not cancelled (``cancel_only_preempting``; prime-rl cancels at any full cache):
   against a real vLLM with 15 free blocks, cancelling at every full poll threw away 26 of 80 rollouts in a job
   where the static cap preempted nothing (tests/real/test_vllm_concurrency.py).
2. **Preemptions** since the last poll are held against a budget (``preemption_budget`` per finished request,
   ``vllm:request_success``; a reserve of ``budget_window`` requests' worth, and at most as much owed). Within
   it they only stop growth at the in-flight count they happened under (the most in flight at this poll or the
   last): a cap at the edge of the cache preempts now and then, and cutting it a group for each cost a simulated
   job a sixth of its throughput. Past it, or with a **persistent queue** (``queue_polls`` polls in a row with
   KV usage at least ``grow_below`` and more requests waiting for capacity than ``queue_ratio`` x those running:
   a request that arrived between two engine iterations waits at any load): the cap is cut to ``cut_factor`` x
   that count, then no further cut until the in-flight count has drained to the cap (what it sees meanwhile is
   the old cap's), and growth stays a step below that count until the budget is repaid.
3. **Soft** (KV usage above ``trim_above``): no growth. The cap is not lowered: a poll past ``trim_above`` is
   often one wave of rollouts at its peak, about to finish (usage swung 0.05-0.95 between polls of a simulated
   job at a steady cap), and closing admission or trimming there held caps a group or more below the best.
4. **Growth**: while the cap binds (no room for another group) and no capacity queue waits, each completion
   grows it by a share of ``grow_factor`` per turnover (as many completions as in flight): the whole factor
   below ``grow_below``, less and less up to ``trim_above`` (prime-rl's #3556 tapers the same way), at most a
   group a poll (completions come in waves). Not past the in-flight count preemptions were last seen under
   until ``probe_after`` turnovers pass without one, within the budget; then a group past it (a probe), and a
   probe that preempts doubles the wait (up to 8x): rollouts that grow in place read as a clear cache while
   they are young, and growing straight back re-ran the preemption every other turnover against a real vLLM.

The cap stays within [``min_per_server``, the ceiling] (the ceiling: ``scheduler.max_inflight``, which also
bounds the whole job). A server whose load cannot be read keeps the ceiling: the static cap.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal

from orchestrator.errors import InferenceError
from orchestrator.inference.load import LoadUnreadable, ServerLoad, parse_load
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.inference.server import HttpStatusError
from orchestrator.rollouts.config import ConcurrencyConfig

if TYPE_CHECKING:
    from orchestrator.contracts.protocol import RolloutRecord

log = logging.getLogger(__name__)
LONGEST_GROUPS = 16  # finished groups a server's expected rollout length is learned from


class Rule(Enum):
    START = "start"  # the first cap: the server's KV capacity over a rollout's tokens
    HOLD = "hold"
    GROW = "grow"
    TRIM = "trim"  # soft
    CANCEL = "cancel"  # hard
    PREEMPTED = "preempted"
    QUEUED = "queued"
    UNREADABLE = "unreadable"  # the static cap


@dataclass(frozen=True)
class Decision:
    rule: Rule
    cap: int
    cancel: int = 0  # rollouts to cancel now (whole groups: the admission stage rounds up)


class ServerCap:
    """One server's cap (see the module docstring). ``ceiling``: ``scheduler.max_inflight``; ``start``: the cap of
    a server that does not say its KV capacity (``start_per_server`` when set, for every server); ``group``: the
    smallest group size (rollouts are in flight in whole groups: the cap binds when another group does not fit)."""

    def __init__(self, cfg: ConcurrencyConfig, ceiling: int, start: int, group: int = 1, *,
                 from_capacity: bool = False) -> None:
        self.cfg = cfg
        self.ceiling = ceiling
        self.group = group
        self.start = self._clamp(start)
        # from_capacity: one group (an idle server takes one whatever its cap) until the first readable poll
        # says the server's KV capacity and a rollout's length is known; ``start`` if it does not say
        first = self._clamp(group) if from_capacity else self.start
        self.last = Decision(Rule.HOLD, first)  # the last decision: its cap is the cap now
        self.level = float(first)  # the cap before rounding down: growth per completion adds fractions of one
        self.started = not from_capacity
        self.draining = False  # after a cut: no further cut until in flight <= cap
        self._preemptions: int | None = None  # the server's counter at the last poll
        self._queued_polls = 0
        self._preempting_polls = 0  # polls in a row that saw preemptions at usage past cancel_above
        self._inflight = 0  # in flight at the last poll
        self._completed = 0  # completions at the last poll
        # the in-flight count preemptions were last seen under, and the completions then
        self._limit: tuple[int, int] | None = None
        self._probing = False  # the limit was raised a group after a quiet while; not yet preempted there
        self._wait = cfg.probe_after  # turnovers without a preemption before growth may pass the limit
        self._over = False  # over the preemption budget at the last poll
        # the preemption budget, a token bucket: preemptions the server may still have without a cut, and the
        # counters (requests finished, preemptions) at the last poll
        self._tokens = cfg.preemption_budget * cfg.budget_window
        self._counts: tuple[int, int] | None = None

    def observe(self, load: ServerLoad | None, inflight: int, completed: int,
                rollout_tokens: int | None = None) -> Decision:
        """One poll: ``load`` (None: unreadable), this server's rollouts in flight, its completions so far
        (cumulative) and the KV tokens one rollout is expected to hold at its longest (None: not known yet).
        The decision is kept in ``last``."""
        before = self.cap
        self.last = self._decide(load, inflight, completed, rollout_tokens)
        if self.last.cap < before or self.last.rule in (Rule.START, Rule.UNREADABLE):
            self.level = float(self.last.cap)
        self._completed = completed
        return self.last

    @property
    def cap(self) -> int:
        return self.last.cap

    def _decide(self, load: ServerLoad | None, inflight: int, completed: int,
                rollout_tokens: int | None) -> Decision:
        # preemptions since the last poll happened under the in-flight count then or now, whichever is more:
        # blaming what was left after a drain held a simulated job's cap a group low to its end
        peak, self._inflight = max(inflight, self._inflight), inflight
        if load is None:
            self._preemptions, self._queued_polls, self._preempting_polls = None, 0, 0
            self._counts = None
            return Decision(Rule.UNREADABLE, self.ceiling)
        preempted = self._preemptions is not None and load.preemptions > self._preemptions
        self._preemptions = load.preemptions
        over_budget = self._over = self._over_budget(load, preempted)
        if not self.started:
            if load.capacity_tokens is not None and rollout_tokens is None:
                return Decision(Rule.HOLD, self.cap)  # one group until a rollout's length is known
            self.started = True
            if load.capacity_tokens is None:  # not said: ``start``, as a static cap would
                return Decision(Rule.START, self.start)
            return Decision(Rule.START, self._clamp(load.capacity_tokens // max(rollout_tokens or 1, 1)))
        if self.draining and inflight <= self.cap:
            self.draining = False
        cfg = self.cfg
        waiting = load.waiting_for_capacity if load.waiting_for_capacity is not None else load.waiting
        queued = load.usage >= cfg.grow_below and waiting > cfg.queue_ratio * load.running
        self._queued_polls = self._queued_polls + 1 if queued else 0
        hard = load.usage > cfg.cancel_above and (preempted or not cfg.cancel_only_preempting)
        self._preempting_polls = self._preempting_polls + 1 if hard else 0
        if hard and not self.draining and self._preempting_polls >= cfg.cancel_polls:
            self.draining = True  # the cancelled requests leave the cache by the next poll; wait for that
            target = self._trimmed(inflight, load.usage)
            return Decision(Rule.CANCEL, min(target, self.cap), max(inflight - target, 0))
        if preempted:
            self._remember(peak, completed)
            if not over_budget:  # within the budget: no cut
                return Decision(Rule.HOLD, self.cap)
        if (preempted or self._queued_polls >= cfg.queue_polls) and not self.draining:
            self.draining = True
            self._queued_polls = 0
            cap = self._clamp(math.floor(max(peak if preempted else inflight, cfg.min_per_server) * cfg.cut_factor))
            return Decision(Rule.PREEMPTED if preempted else Rule.QUEUED, min(cap, self.cap))
        if load.usage > cfg.trim_above:
            return Decision(Rule.TRIM, self.cap)
        if self._grows(load, inflight, waiting) and (grown := self._grown(load.usage, inflight, completed)) > self.cap:
            return Decision(Rule.GROW, grown)
        return Decision(Rule.HOLD, self.cap)

    def _remember(self, peak: int, completed: int) -> None:
        """Preemptions happened under ``peak`` rollouts in flight: growth stops there (below it while over the
        budget). Each ``_wait`` turnovers without one (within the budget) raise that limit by a group (a probe);
        a probe that preempts doubles the wait, up to 8 x ``probe_after``."""
        peak = max(peak, 1)
        if self._limit is None:
            self._limit = (peak, completed)
            return
        if self._probing and peak >= self._limit[0]:
            self._wait = min(2 * self._wait, 8 * self.cfg.probe_after)
        self._probing = False
        self._limit = (min(self._limit[0], peak), completed)

    def _over_budget(self, load: ServerLoad, preempted: bool) -> bool:
        """Whether the server's preemptions are over the budget: a bucket of ``preemption_budget`` x
        ``budget_window`` preemptions, refilled by ``preemption_budget`` per request finished, emptied by each
        preemption, owing at most as much; over while it is below zero. Without a request counter (or a budget
        of 0) a poll that saw preemptions is over it."""
        cfg = self.cfg
        if load.finished is None or cfg.preemption_budget == 0:
            return preempted
        counts = (load.finished, load.preemptions)
        if self._counts is not None and all(now >= then for now, then in zip(counts, self._counts, strict=True)):
            finished, spent = counts[0] - self._counts[0], counts[1] - self._counts[1]
            bucket = cfg.preemption_budget * cfg.budget_window  # owed at most as much: a burst is repaid in
            # at most 2 x budget_window requests
            self._tokens = max(min(self._tokens + cfg.preemption_budget * finished, bucket) - spent, -bucket)
        self._counts = counts  # (a server that restarted counts from zero again: learnt here, nothing spent)
        return self._tokens < 0

    def _grown(self, usage: float, inflight: int, completed: int) -> int:
        """The cap the completions since the last poll grow it to: ``grow_factor`` per turnover (as many
        completions as in flight), a share of it per completion, tapered from full below ``grow_below`` to none
        at ``trim_above``, at most a group a poll; not past the limit preemptions set (``_remember``), nor up to
        it while over the budget."""
        cfg = self.cfg
        taper = min(1.0, max(0.0, (cfg.trim_above - usage) / (cfg.trim_above - cfg.grow_below)))
        factor = 1 + (cfg.grow_factor - 1) * taper
        self.level = min(self.level * factor ** ((completed - self._completed) / max(inflight, 1)),
                         float(self.ceiling))
        # at most one group a poll: completions come in waves, and a turnover's growth at once overshot
        self.level = min(self.level, float(self.cap + self.group))
        grown = self._clamp(math.floor(self.level + 1e-9))
        if self._limit is not None:
            level, since = self._limit
            if not self._over and (completed - since) / max(self.cap, 1) >= self._wait:
                level = min(level + self.group, self.ceiling)  # quiet long enough: probe a group more
                self._limit, self._probing = (level, completed), True
            grown = min(grown, level - 1 if self._over else level)
            self.level = min(self.level, float(grown) + 0.999)
        return grown

    def _grows(self, load: ServerLoad, inflight: int, waiting: int) -> bool:
        binds = inflight + self.group > self.cap  # no room for one more group
        queue = waiting > 0 and load.usage >= self.cfg.grow_below
        return not self.draining and not queue and binds and self.cap < self.ceiling

    def _trimmed(self, inflight: int, usage: float) -> int:
        return self._clamp(math.floor(inflight * self.cfg.trim_to / usage))

    def _clamp(self, n: int) -> int:
        return max(self.cfg.min_per_server, min(self.ceiling, n))


def context_tokens(record: RolloutRecord) -> int:
    """The tokens a rollout's context held at its end: its longest sample's (a multi-turn rollout's context at
    its last turn), else its token count (an evaluation rollout builds no samples; a failed one has neither: 0)."""
    return max((shape[0] for shape in record.header.samples), default=record.tokens)


class ConcurrencyControl:
    """Every server's cap, kept by polling its ``/metrics`` (see the module docstring).

    ``run()`` consumes, every ``poll_s``, each in-rotation server's ``/metrics`` (read concurrently, each bounded by
    ``poll_s``; parsed in a worker thread: a real server's text is ~570 lines) and produces each server's cap in
    ``pool`` (``Server.cap``, which ``InferencePool.take`` obeys), a call of ``raised()`` when a cap goes up (the
    admission stage looks again) and, for a hard trim, a call of ``cancel(server, n)``. A server out of rotation
    (also one that left while its poll ran) keeps its cap; a call that fails or an HTTP error other than 404
    (the server is going away, or busy) changes nothing. A server whose ``/metrics`` cannot be read (404, or not
    vLLM's families) gets the static cap, said once in the log until it can be read again. ``group``: the
    smallest group size. Completions pace growth: every group that leaves a server counts, cancelled or not."""

    def __init__(self, cfg: ConcurrencyConfig, pool: InferencePool, ceiling: int, group: int,
                 cancel: Callable[[Server, int], None], raised: Callable[[], None] = lambda: None) -> None:
        self.cfg, self.pool, self.cancel, self.raised = cfg, pool, cancel, raised
        start = cfg.start_per_server or max(1, ceiling // len(pool.servers))
        # a server that joins while the job runs (inference.discover) gets one too
        self._fresh = functools.partial(ServerCap, cfg, ceiling, start, group,
                                        from_capacity=cfg.start_per_server is None)
        self.caps = {s.url: self._fresh() for s in pool.servers}
        self.loads: dict[str, ServerLoad | None] = {}
        self.completed: Counter[str] = Counter()  # completed rollouts per server (``done``)
        # per server: the longest rollout of each of the last LONGEST_GROUPS groups that finished there
        self.longest: collections.defaultdict[str, collections.deque[int]] = collections.defaultdict(
            functools.partial(collections.deque, maxlen=LONGEST_GROUPS))
        self._unreadable: set[str] = set()
        for s in pool.servers:
            pool.set_cap(s, self.caps[s.url].cap)

    def done(self, server: Server, n: int = 1, longest: int = 0) -> None:
        """``n`` rollouts on ``server`` completed (the turnover that paces growth), the longest of them holding
        ``longest`` tokens at its end (0: not known, e.g. all failed)."""
        self.completed[server.url] += n
        if longest > 0:
            self.longest[server.url].append(longest)

    def rollout_tokens(self, server: Server) -> int | None:
        """The KV tokens a rollout on ``server`` is expected to hold at its longest: ``rollout_tokens`` when set,
        else the longest of the last groups that finished there (None: none has yet)."""
        return self.cfg.rollout_tokens or max(self.longest[server.url], default=None)

    async def run(self) -> None:
        """See the class docstring. Polls at once (the first cap comes from the server's KV capacity), then
        every ``poll_s``; runs until cancelled."""
        while True:
            await self.poll()
            await asyncio.sleep(self.cfg.poll_s)

    async def poll(self) -> None:
        """One poll of every server in rotation, and the caps it decides."""
        live = [s for s in self.pool.servers if s.in_rotation]
        for server in live:
            if server.url not in self.caps:  # joined while the job runs (inference.discover)
                self.caps[server.url] = self._fresh()
        for server, load in zip(live, await asyncio.gather(*(self._read(s) for s in live)), strict=True):
            if load is not False and server.in_rotation:  # one that left meanwhile keeps its cap
                self._decide(server, load)

    async def _read(self, server: Server) -> ServerLoad | Literal[False] | None:
        """The server's load; None: its metrics cannot be read; False: no answer (nothing to decide on)."""
        try:
            async with asyncio.timeout(self.cfg.poll_s):
                raw = await server.api.request("GET", "/metrics")
            load = await asyncio.to_thread(parse_load, raw.decode("utf-8", "replace"))
        except HttpStatusError as e:
            if e.status not in (404, 405):  # busy or failing, not without metrics: no news
                return False
            self._cannot_read(server, f"GET /metrics: HTTP {e.status}")
            return None
        except (InferenceError, TimeoutError):
            return False
        except LoadUnreadable as e:
            self._cannot_read(server, str(e))
            return None
        if server.url in self._unreadable:
            self._unreadable.discard(server.url)
            log.info("inference server %s: its /metrics can be read again; its cap follows its KV cache", server.url)
        return load

    def _cannot_read(self, server: Server, why: str) -> None:
        if server.url not in self._unreadable:
            self._unreadable.add(server.url)
            log.warning("inference server %s: its load cannot be read (%s); it keeps the static cap of %d "
                        "rollouts", server.url, why, self.caps[server.url].ceiling)

    def _decide(self, server: Server, load: ServerLoad | None) -> None:
        cap = self.caps[server.url]
        before = cap.cap
        self.loads[server.url] = load
        d = cap.observe(load, server.inflight, self.completed[server.url], self.rollout_tokens(server))
        self.pool.set_cap(server, d.cap)
        if d.cap > before:
            self.raised()
        if d.rule is Rule.START and load is not None and load.capacity_tokens is not None:
            log.info("inference server %s: first cap %d rollouts: its KV cache of %d tokens over %s tokens a "
                     "rollout at its longest", server.url, d.cap, load.capacity_tokens, self.rollout_tokens(server))
        elif d.cap != before and d.rule is not Rule.UNREADABLE:
            usage = f"{load.usage:.2f}" if load is not None else "?"
            log.info("inference server %s: cap %d -> %d (%s; KV usage %s, %d in flight)", server.url, before, d.cap,
                     d.rule.value, usage, server.inflight)
        if d.cancel:
            self.cancel(server, d.cancel)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per server: its cap, the last load read (KV usage, waiting, preemptions), the last decision and the
        tokens a rollout is expected to hold at its longest (what the first cap was sized by)."""
        out = {}
        for url, cap in self.caps.items():
            load = self.loads.get(url)
            out[url] = {"cap": cap.cap, "rule": cap.last.rule.value, "cancel_asked": cap.last.cancel,
                        "kv_usage": load.usage if load else None, "waiting": load.waiting if load else None,
                        "preemptions": load.preemptions if load else None,
                        "rollout_tokens": self.cfg.rollout_tokens or max(self.longest[url], default=None)}
        return out
