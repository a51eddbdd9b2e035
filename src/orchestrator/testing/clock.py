"""Virtual time for asyncio: timing rules tested at full speed, without waiting for the clock.

Every timing rule of the orchestrator (worker supervision and restart back-off, the pool's probes and liveness
checks, concurrency polling, stall lines, refused-checkpoint rechecks, send warnings) reads the time from the
running event loop (``loop.time()``) and waits with ``asyncio.sleep`` / ``asyncio.timeout``. So an event loop whose
clock is virtual drives them all: ``VirtualClockLoop`` keeps its own time, and whenever every task is waiting and
nothing is ready to read, it jumps that time to the next timer instead of sleeping (trio's ``MockClock`` with
``autojump_threshold=0`` is the model). A test of a 30 s silence bound or a 60 s back-off then takes
milliseconds, and cannot fail because a loaded machine was slow: time only moves when nothing else can happen.

Use::

    from orchestrator.testing.clock import virtual_time

    @virtual_time                  # a plain function for pytest: pytest-asyncio leaves it alone
    async def test_a_silent_worker_is_lost(caplog):
        loop = asyncio.get_running_loop()
        ...                        # await asyncio.sleep(3600) returns at once, with loop.time() 3600 s later

or ``run(main())``, the ``asyncio.run`` of a virtual clock.

What moves the clock, and what does not:
- It jumps only when the loop would block: no callback ready, nothing to read or write on any registered socket or
  pipe. Work of the loop itself (tasks, callbacks) takes no virtual time.
- While work runs in the loop's executor (``asyncio.to_thread``, ``run_in_executor``, ``getaddrinfo``) it does not
  jump: it moves by the real time the loop waits for that work, as a real clock would.
- Sockets within the process (a loopback server on the same loop) are read when data is there when the loop looks;
  loopback data is normally there at once, but under heavy load the kernel may deliver it a little later, after a
  timer has jumped. ``autojump_threshold`` (seconds of real time the loop waits for I/O before it jumps) covers
  that; the default, 0, suits code that talks to in-memory fakes (``FakeInferenceServer``, ``asyncio`` queues).
- Subprocesses, and other processes generally, live in real time: a test with real processes wants a real clock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import selectors
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar, TypeVarTuple

__all__ = ["VirtualClockLoop", "run", "virtual_time"]

T = TypeVar("T")
P = ParamSpec("P")
Ts = TypeVarTuple("Ts")


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (see the module docstring). ``start``: ``loop.time()`` at first;
    ``autojump_threshold``: real seconds it waits for I/O before it jumps to the next timer."""

    def __init__(self, *, start: float = 0.0, autojump_threshold: float = 0.0) -> None:
        self._now = start
        self._threshold = autojump_threshold
        self._in_executor = 0  # calls running in the executor: real work, so the clock follows real time
        self.jumps = 0  # how many times the clock jumped (a test may check that time was virtual)
        super().__init__(_JumpingSelector(self))
        if autojump_threshold < 0:
            self.close()
            raise ValueError("autojump_threshold must be >= 0 (seconds of real time)")

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (timers now due run at the loop's next iteration)."""
        if seconds < 0:
            raise ValueError("virtual time goes forward only")
        self._now += seconds

    def run_in_executor(self, executor: concurrent.futures.Executor | None, func: Callable[[*Ts], T],
                        *args: *Ts) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self._in_executor += 1
        future.add_done_callback(self._executor_done)
        return future

    def _executor_done(self, _future: asyncio.Future[Any]) -> None:
        self._in_executor -= 1


class _JumpingSelector(selectors.DefaultSelector):
    """The platform's selector, whose blocking ``select`` moves the loop's virtual clock instead of waiting
    (the rules in the module docstring). The loop's select is given the time to its next timer (None: no timer;
    0: work is ready)."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self._loop
        if timeout is not None and timeout <= 0:
            return super().select(0)
        if loop._in_executor:  # threads at work: real time passes, and the clock with it
            t0 = time.monotonic()
            events = super().select(timeout)
            loop._now += time.monotonic() - t0
            return events
        threshold = loop._threshold if timeout is None else min(loop._threshold, timeout)
        events = super().select(threshold)
        if events:
            return events
        if timeout is None:  # nothing will ever be due: only I/O (or another thread) can wake the loop
            return super().select(None)
        loop._now += timeout
        loop.jumps += 1
        return []


def run(main: Coroutine[Any, Any, T], *, start: float = 0.0, autojump_threshold: float = 0.0) -> T:
    """Run ``main`` to completion on a fresh ``VirtualClockLoop`` (``asyncio.run``'s cleanup: pending tasks
    cancelled, async generators and the default executor shut down)."""
    with asyncio.Runner(loop_factory=lambda: VirtualClockLoop(start=start, autojump_threshold=autojump_threshold)
                        ) as runner:
        return runner.run(main)


def virtual_time(test: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, T]:
    """``test`` (an ``async def``) as a plain function that runs it on a virtual clock (``run``); its arguments
    (pytest fixtures: ``tmp_path``, ``caplog``...) pass through. Async fixtures do not mix with it: they would run
    on another loop."""

    @functools.wraps(test)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        return run(test(*args, **kwargs))

    return wrapper
