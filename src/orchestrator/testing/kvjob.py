"""A whole adaptive-concurrency job in virtual time: the simulator's KV engine (sim/kv.py's ``KVEngine``, the model
the benchmark's server runs) serving multi-turn rollouts that open in groups under a cap, and ``ServerCap`` (the
real rules) polled every ``poll_s`` of virtual time, as ``ConcurrencyControl`` polls a server's ``/metrics``.

No clock, no I/O, seeded: a job of a few hundred rollouts runs in a fraction of a second and gives the same
figures every time, so the controller's rules can be checked on machines of any speed (``KVModel.step_ms``),
reply lengths and poll intervals, poll by poll (``VirtualJob.trace``), where a real benchmark pass takes minutes
and its figures swing with the host's load. ``run_job(spec, cap=None)``: the adaptive cap under
``spec.ceiling``; ``cap=N``: a static cap of N rollouts.

What it models of a real job: each rollout is ``turns`` requests of ``reply`` tokens each, the first of
``prompt`` tokens, each later one the context so far plus ``user`` tokens (a new turn recomputes its whole
context: the simulator has no prefix cache); between two turns ``env_ms`` pass outside the engine (the env
worker, HTTP), more with more rollouts in flight (``env_ms_per_inflight``: they share the host's cores); a
rollout's length for the first cap is learned as ``ConcurrencyControl`` learns it (the longest of the last
groups); a group of ``group`` rollouts opens whenever it fits under the cap (an idle server always takes one
group); a hard trim cancels whole groups not yet half done, youngest first, never the oldest (as
``GroupTracker.shed``). What it leaves out: steps, weight syncs, the loop's own delays.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import random
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field

from orchestrator.inference.load import ServerLoad
from orchestrator.rollouts.concurrency import LONGEST_GROUPS, Decision, Rule, ServerCap
from orchestrator.rollouts.config import ConcurrencyConfig
from orchestrator.sim.kv import KVEngine, KVModel


@dataclass(frozen=True)
class JobSpec:
    kv: KVModel
    concurrency: ConcurrencyConfig = field(default_factory=lambda: ConcurrencyConfig(adaptive=True, poll_s=0.5))
    ceiling: int = 64  # scheduler.max_inflight
    rollouts: int = 480  # the job's length, in rollouts started
    group: int = 4
    turns: int = 6
    reply: int = 64  # tokens per turn (the benchmark's min_tokens = max_tokens)
    prompt: int = 60
    user: int = 8  # tokens an env's answer adds between turns
    env_ms: float = 30.0  # between two turns of a rollout, outside the engine ...
    env_ms_per_inflight: float = 0.0  # ... plus this per rollout in flight (env workers and the loop share cores),
    env_jitter: float = 0.5  # ... times a uniform draw in 1 +- this
    early_stop: float = 0.05  # chance that a rollout ends after any turn but its last (a guess found)
    seed: int = 0
    advertise_capacity: bool = True  # /metrics carries vllm:cache_config_info (vLLM >= 0.26 does) ...
    count_requests: bool = True  # ... and vllm:request_success


@dataclass(frozen=True)
class Poll:
    t: float  # virtual seconds
    usage: float
    running: int
    waiting: int
    inflight: int
    completed: int
    decision: Decision


@dataclass
class JobResult:
    tokens_per_s: float  # reply tokens of rollouts that finished in the steady window, over its length
    preemption_rate: float  # preemptions in the window per request submitted in it
    cancelled: int  # rollouts cancelled (whole job)
    warmup_cancelled: int  # of those, in the first third
    usage_mean: float  # over the window's polls
    cap_median: float  # over the window's polls
    trace: list[Poll]


@dataclass(eq=False)
class _Rollout:
    group: int
    turns: int
    turn: int = 0
    context: int = 0
    tokens: int = 0
    done: bool = False
    cancelled: bool = False


class VirtualJob:
    """One job (module docstring). ``run()`` returns its ``JobResult``."""

    def __init__(self, spec: JobSpec, cap: int | None) -> None:
        self.spec = spec
        self.engine = KVEngine(spec.kv)
        self.rng = random.Random(spec.seed)
        self.static = cap or 0
        cfg = spec.concurrency
        self.ctl = None if cap is not None else ServerCap(cfg, spec.ceiling, cfg.start_per_server or spec.ceiling,
                                                          spec.group, from_capacity=cfg.start_per_server is None)
        self.now = 0.0
        self._events: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._stepping = False
        self.groups: dict[int, list[_Rollout]] = {}  # open groups, oldest first
        self.inflight = self.completed = self.started = self.requests = 0
        self.finished: list[tuple[float, int]] = []  # (when, reply tokens) of each finished rollout
        self.submits: list[float] = []
        self.preempt_at: list[tuple[float, int]] = []
        self.cancels: list[float] = []
        self.trace: list[Poll] = []
        self.longest: collections.deque[int] = collections.deque(maxlen=LONGEST_GROUPS)  # each group's longest

    @property
    def cap(self) -> int:
        return self.static if self.ctl is None else self.ctl.cap

    def run(self) -> JobResult:
        self._at(0.0, "poll", None)
        self._admit()
        while self._events and (self.started < self.spec.rollouts or self.inflight):
            self.now, _, kind, data = heapq.heappop(self._events)
            if kind == "step":
                self._step_end(data)  # type: ignore[arg-type]
            elif kind == "turn":
                self._submit(data)  # type: ignore[arg-type]
            elif kind == "poll":
                self._poll()
                self._at(self.now + self.spec.concurrency.poll_s, "poll", None)
        return self._result()

    def _at(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, data))

    def _admit(self) -> None:
        s = self.spec
        while self.started < s.rollouts and (self.inflight == 0 or self.inflight + s.group <= self.cap):
            gid = next(self._seq)
            members = [_Rollout(gid, self._turns()) for _ in range(s.group)]
            self.groups[gid] = members
            self.started += s.group
            self.inflight += s.group
            for r in members:
                r.context = s.prompt
                self._submit(r)

    def _turns(self) -> int:
        n = 1
        while n < self.spec.turns and self.rng.random() >= self.spec.early_stop:
            n += 1
        return n

    def _submit(self, r: _Rollout) -> None:
        if r.cancelled:
            return
        self.requests += 1
        self.submits.append(self.now)
        self.engine.submit(r, r.context, self.spec.reply)
        if not self._stepping:
            self._start_step()

    def _start_step(self) -> None:
        before = self.engine.preemptions
        ms, finished = self.engine.step()
        if self.engine.preemptions > before:
            self.preempt_at.append((self.now, self.engine.preemptions - before))
        self._stepping = True
        self._at(self.now + ms / 1e3, "step", finished)

    def _step_end(self, finished: list[_Rollout]) -> None:
        s = self.spec
        for r in finished:  # what this admits waits for the next step
            if r.cancelled:
                continue
            r.turn += 1
            r.tokens += self.spec.reply
            r.context += self.spec.reply + self.spec.user
            if r.turn < r.turns:
                jitter = 1 + s.env_jitter * (2 * self.rng.random() - 1)
                self._at(self.now + (s.env_ms + s.env_ms_per_inflight * self.inflight) * jitter / 1e3, "turn", r)
            else:
                r.done = True
                self.finished.append((self.now, r.tokens))
                self._leave(r)
        self._stepping = False
        if self.engine.busy:
            self._start_step()

    def _leave(self, r: _Rollout) -> None:
        members = self.groups.get(r.group)
        if members is not None and all(m.done or m.cancelled for m in members):
            del self.groups[r.group]
            self.inflight -= len(members)
            self.completed += len(members)
            self.longest.append(max(m.context - self.spec.user for m in members))
            self._admit()

    def _poll(self) -> None:
        kv = self.engine.load()
        if self.ctl is None:  # a static cap: only the readings
            self.trace.append(Poll(self.now, kv.usage, kv.running, kv.waiting, self.inflight, self.completed,
                                   Decision(Rule.HOLD, self.cap)))
            return
        capacity = self.spec.kv.blocks * self.spec.kv.block_tokens if self.spec.advertise_capacity else None
        load = ServerLoad(usage=kv.usage, running=kv.running, waiting=kv.waiting, waiting_for_capacity=kv.waiting,
                          preemptions=kv.preemptions, engines=1, capacity_tokens=capacity,
                          finished=kv.finished if self.spec.count_requests else None)
        before = self.ctl.cap
        d = self.ctl.observe(load, self.inflight, self.completed, max(self.longest, default=None))
        self.trace.append(Poll(self.now, kv.usage, kv.running, kv.waiting, self.inflight, self.completed, d))
        if d.cancel:
            self._shed(d.cancel)
        if d.cap > before:
            self._admit()

    def _shed(self, n: int) -> None:
        """Whole groups not yet half done, youngest first, never the oldest (GroupTracker.shed)."""
        for gid in list(reversed(self.groups))[:-1]:
            if n <= 0:
                break
            members = self.groups[gid]
            if sum(m.done for m in members) * 2 >= len(members):
                continue
            for m in members:
                if not m.done:
                    m.cancelled = True
                    self.engine.cancel(m)
                    self.cancels.append(self.now)
            del self.groups[gid]
            self.inflight -= len(members)
            self.completed += len(members)
            n -= len(members)
        self._admit()

    def _result(self) -> JobResult:
        end = self.now
        t0 = end / 3
        window = end - t0
        tokens = sum(n for t, n in self.finished if t >= t0)
        requests = sum(1 for t in self.submits if t >= t0)
        preempted = sum(n for t, n in self.preempt_at if t >= t0)
        polls = [p for p in self.trace if p.t >= t0]
        return JobResult(tokens_per_s=tokens / window, preemption_rate=preempted / max(requests, 1),
                         cancelled=len(self.cancels), warmup_cancelled=sum(1 for t in self.cancels if t < t0),
                         usage_mean=statistics.fmean(p.usage for p in polls) if polls else 0.0,
                         cap_median=statistics.median(p.decision.cap for p in polls) if polls else float(self.cap),
                         trace=self.trace)


def run_job(spec: JobSpec, cap: int | None = None) -> JobResult:
    """One job: the adaptive cap (``cap`` None) or a static cap of ``cap`` rollouts."""
    return VirtualJob(spec, cap).run()


def format_trace(trace: list[Poll]) -> Iterator[str]:
    """One line per poll that changed the cap, or every poll's usage: for reading why a cap settled where it did."""
    for p in trace:
        d = p.decision
        yield (f"{p.t:7.2f}s usage {p.usage:.2f} run {p.running:3d} wait {p.waiting:3d} inflight {p.inflight:3d} "
               f"done {p.completed:4d} -> {d.rule.value:9s} cap {d.cap:3d}"
               + (f" cancel {d.cancel}" if d.cancel else ""))
