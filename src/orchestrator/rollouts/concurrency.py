"""How many rollouts each inference server may run at once, following its KV cache (``[scheduler.concurrency]``).

A static ``max_inflight`` is wrong in both directions on a real fleet: too low and the engines idle; too high and
the KV cache fills, vLLM preempts and recomputes, and throughput collapses, worst for long multi-turn rollouts
whose contexts grow in place. ``ServerCap`` is one server's cap, moved by what its ``/metrics`` say
(inference/load.py) at each poll. Pure: no I/O, no clock; the poller feeds it and the admission stage obeys it.

The rules, in order, each with its setting (defaults from prime-rl's controller at 559b447, whose values are
module constants there):

1. **Hard** (KV usage above ``cancel_above`` while the server preempts): the cap becomes what would hold the cache
   at ``trim_to`` (in flight x ``trim_to`` / usage), and the rollouts above it are cancelled (whole groups not
   yet half done, youngest first, never a server's oldest group: groups.py ``shed``). Then nothing more is
   cancelled or cut until the in-flight count has drained to the cap: the cancelled requests are still leaving
   (a hard load only trims). A full cache that does not preempt only queues (vLLM admits a request when its
   blocks are free), so it is trimmed, not cancelled (``cancel_only_preempting``; prime-rl cancels at any full
   cache): against a real vLLM with 15 free blocks, cancelling at every full poll threw away 26 of 80 rollouts
   in a job where the static cap preempted nothing (tests/real/test_vllm_concurrency.py).
2. **Preemptions** since the last poll, or a **persistent queue** (``queue_polls`` polls in a row with KV usage at
   least ``grow_below`` and more requests waiting for capacity than ``queue_ratio`` x those running: a request
   that arrived between two engine iterations waits at any load, and is no sign of a full cache): cut the cap
   to ``cut_factor`` x what is in flight (for preemptions: the most in flight at this poll or the last, the load
   they happened under), then no further cut until the in-flight count has drained to the cap: the overload
   seen while draining is the old cap's.
3. **Soft** (KV usage above ``trim_above``): admission closes: the cap becomes what is in flight (never raised).
   Nothing is cancelled, and the cap is not sized from this reading: a poll past ``trim_above`` is often the
   peak of rollouts about to finish (usage swung 0.05-0.95 between polls of a simulated job at a steady cap),
   and trimming to ``trim_to`` there cut the cap a group at a time, to 0.81 of the best static cap's
   throughput. What grows past it in place ends in preemptions (a cut) or a full cache that preempts (hard).
4. **Growth**: while KV usage is below ``grow_below``, nothing waits, and the cap binds (as many in flight as it
   allows), the cap grows by ``grow_factor`` once per turnover (as many completions on the server as the cap
   since the last growth). After a cut on preemptions it stays below the in-flight count that preempted for
   ``probe_after`` turnovers, then may reach it (a probe), and pass it once it held as long again; a probe that
   preempts doubles the wait (up to 8x): rollouts that grow in place read as a clear cache while they are young,
   and growing straight back re-ran the preemption every other turnover against a real vLLM.

The cap stays within [``min_per_server``, the ceiling] (the ceiling: ``scheduler.max_inflight``, which also
bounds the whole job). A server whose load cannot be read keeps the ceiling: the static cap.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from orchestrator.errors import InferenceError
from orchestrator.inference.load import LoadUnreadable, ServerLoad, parse_load
from orchestrator.inference.pool import InferencePool, Server
from orchestrator.inference.server import HttpStatusError
from orchestrator.rollouts.config import ConcurrencyConfig

log = logging.getLogger(__name__)


class Rule(Enum):
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
    """One server's cap (see the module docstring). ``ceiling``: ``scheduler.max_inflight``; ``group``: the
    smallest group size (rollouts are in flight in whole groups: the cap binds when another group does not fit)."""

    def __init__(self, cfg: ConcurrencyConfig, ceiling: int, start: int, group: int = 1) -> None:
        self.cfg = cfg
        self.ceiling = ceiling
        self.group = group
        self.last = Decision(Rule.HOLD, self._clamp(start))  # the last decision: its cap is the cap now
        self.draining = False  # after a cut: no further cut until in flight <= cap
        self._preemptions: int | None = None  # the server's counter at the last poll
        self._queued_polls = 0
        self._inflight = 0  # in flight at the last poll
        self._completed_at_growth = 0
        # after a cut on preemptions: (the in-flight count that preempted, completions then, turnovers to wait)
        self._hurt: tuple[int, int, int] | None = None

    def observe(self, load: ServerLoad | None, inflight: int, completed: int) -> Decision:
        """One poll: ``load`` (None: unreadable), this server's rollouts in flight, and its completions so far
        (cumulative). The decision is kept in ``last``."""
        self.last = self._decide(load, inflight, completed)
        return self.last

    @property
    def cap(self) -> int:
        return self.last.cap

    def _decide(self, load: ServerLoad | None, inflight: int, completed: int) -> Decision:
        # preemptions since the last poll happened under the in-flight count then or now, whichever is more:
        # blaming what was left after a drain held a simulated job's cap a group low to its end
        peak, self._inflight = max(inflight, self._inflight), inflight
        if load is None:
            self._preemptions, self._queued_polls = None, 0
            return Decision(Rule.UNREADABLE, self.ceiling)
        if self.draining and inflight <= self.cap:
            self.draining = False
        preempted = self._preemptions is not None and load.preemptions > self._preemptions
        self._preemptions = load.preemptions
        cfg = self.cfg
        waiting = load.waiting_for_capacity if load.waiting_for_capacity is not None else load.waiting
        queued = load.usage >= cfg.grow_below and waiting > cfg.queue_ratio * load.running
        self._queued_polls = self._queued_polls + 1 if queued else 0
        if load.usage > cfg.cancel_above and not self.draining and (preempted or not cfg.cancel_only_preempting):
            self.draining = True  # the cancelled requests leave the cache by the next poll; wait for that
            target = self._trimmed(inflight, load.usage)
            return Decision(Rule.CANCEL, min(target, self.cap), max(inflight - target, 0))
        if (preempted or self._queued_polls >= cfg.queue_polls) and not self.draining:
            self.draining = True
            self._queued_polls = 0
            cap = self._clamp(math.floor(max(peak if preempted else inflight, cfg.min_per_server) * cfg.cut_factor))
            if preempted:  # preempting again while the last one is remembered (a probe failed): wait twice as long
                wait = cfg.probe_after if self._hurt is None else min(2 * self._hurt[2], 8 * cfg.probe_after)
                self._hurt = (max(peak, 1), completed, wait)
            return Decision(Rule.PREEMPTED if preempted else Rule.QUEUED, min(cap, self.cap))
        if load.usage > cfg.trim_above:
            return Decision(Rule.TRIM, min(self._clamp(inflight), self.cap))
        if self._grows(load, inflight, completed, waiting) and (grown := self._grown(completed)) > self.cap:
            self._completed_at_growth = completed
            return Decision(Rule.GROW, grown)
        return Decision(Rule.HOLD, self.cap)

    def _grown(self, completed: int) -> int:
        """The cap one growth gives. After a cut on preemptions: below the in-flight count that preempted for
        ``probe_after`` turnovers, then up to it (a probe), and past it once it has held as long again."""
        grown = self._clamp(math.ceil(self.cap * self.cfg.grow_factor))
        if self._hurt is not None:
            level, since, wait = self._hurt
            turnovers = (completed - since) / self.cap
            if turnovers >= 2 * wait:
                self._hurt = None
            else:
                grown = min(grown, level - 1 if turnovers < wait else level)
        return grown

    def _grows(self, load: ServerLoad, inflight: int, completed: int, waiting: int) -> bool:
        turned_over = completed - self._completed_at_growth >= self.cap
        binds = inflight + self.group > self.cap  # no room for one more group
        return (not self.draining and load.usage < self.cfg.grow_below and waiting == 0 and binds and turned_over
                and self.cap < self.ceiling)

    def _trimmed(self, inflight: int, usage: float) -> int:
        return self._clamp(math.floor(inflight * self.cfg.trim_to / usage))

    def _clamp(self, n: int) -> int:
        return max(self.cfg.min_per_server, min(self.ceiling, n))


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
        self._fresh = functools.partial(ServerCap, cfg, ceiling, start, group)  # a server that joins gets one too
        self.caps = {s.url: self._fresh() for s in pool.servers}
        self.loads: dict[str, ServerLoad | None] = {}
        self.completed: Counter[str] = Counter()  # completed rollouts per server (``done``)
        self._unreadable: set[str] = set()
        for s in pool.servers:
            pool.set_cap(s, self.caps[s.url].cap)

    def done(self, server: Server, n: int = 1) -> None:
        """``n`` rollouts on ``server`` completed (the turnover that paces growth)."""
        self.completed[server.url] += n

    async def run(self) -> None:
        """See the class docstring. Wakes every ``poll_s``; runs until cancelled."""
        while True:
            await asyncio.sleep(self.cfg.poll_s)
            await self.poll()

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
        d = cap.observe(load, server.inflight, self.completed[server.url])
        self.pool.set_cap(server, d.cap)
        if d.cap > before:
            self.raised()
        if d.cap != before and d.rule is not Rule.UNREADABLE:
            usage = f"{load.usage:.2f}" if load is not None else "?"
            log.info("inference server %s: cap %d -> %d (%s; KV usage %s, %d in flight)", server.url, before, d.cap,
                     d.rule.value, usage, server.inflight)
        if d.cancel:
            self.cancel(server, d.cancel)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per server: its cap, the last load read (KV usage, waiting, preemptions) and the last decision."""
        out = {}
        for url, cap in self.caps.items():
            load = self.loads.get(url)
            out[url] = {"cap": cap.cap, "rule": cap.last.rule.value, "cancel_asked": cap.last.cancel,
                        "kv_usage": load.usage if load else None, "waiting": load.waiting if load else None,
                        "preemptions": load.preemptions if load else None}
        return out
