"""The simulated engine's pause state, and the generate requests waiting inside it.

A generate request enters with ``async with gate.inflight() as aborted``: while the engine is paused it is
queued there until ``resume()`` (vLLM's scheduler queues requests that arrive during a pause; the 0.33 refusal
is the caller's check, before entering). Inside, ``hold(delay)`` is where it waits, as a request the engine is
generating: first its injected latency, then while ``holding`` is on (``Faults.hold``: a generation that lasts
until a test ends it), then, while a keep pause is in force, until ``resume()``. ``pause(mode)`` treats
requests as vLLM does:

- ``abort``: every request waiting in the server, queued or inside, ends at once (``inflight`` yields True, or
  ``hold`` returns True: the request answers ``finish_reason: "abort"``); later ones queue;
- ``wait``: requests inside run on; ``drained()`` returns once none is inside (``/pause?mode=wait`` awaits
  it); a request a keep pause froze runs on too;
- ``keep``: a request that finishes its latency (or hold) stays frozen until ``resume()``, then samples with
  the weights loaded at that moment.

Nothing here is bounded: requests wait as long as the pause lasts, as on the real servers (the client's
timeout is the bound). Everything runs on the server's event loop; no task is started. ``wait_until`` lets
tests synchronise on the state (``GateState``) instead of sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, get_args

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[PauseMode, ...] = get_args(PauseMode)


@dataclass(frozen=True)
class GateState:
    mode: PauseMode | None  # None: running
    queued: int  # arrived during a pause, waiting for resume
    running: int  # inside, in their latency or held
    frozen: int  # inside, frozen by a keep pause
    inside: int  # admitted and not answered yet (running, frozen, or sampling)
    hung: int  # never to be answered (``Faults.hang_rate``); not admitted, not touched by pauses


class Gate:
    def __init__(self) -> None:
        self.mode: PauseMode | None = None
        self.holding = False  # requests inside stay there, generating, until it is turned off
        # each future is one waiting request; its result True means an abort pause ended the wait
        self._queued: set[asyncio.Future[bool]] = set()
        self._sleeping: set[asyncio.Future[bool]] = set()
        self._held: set[asyncio.Future[bool]] = set()
        self._frozen: set[asyncio.Future[bool]] = set()
        self._hung: set[asyncio.Future[None]] = set()
        self._inside = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._changed = asyncio.Event()

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def state(self) -> GateState:
        return GateState(self.mode, len(self._queued), len(self._sleeping) + len(self._held), len(self._frozen),
                         self._inside, len(self._hung))

    async def wait_until(self, done: Callable[[GateState], bool]) -> GateState:
        """Return the state once ``done(state)`` holds (re-checked on every change)."""
        while not done(state := self.state()):
            await self._changed.wait()
        return state

    def pause(self, mode: PauseMode) -> None:
        """Pause now; an abort ends every wait, a wait pause releases requests a keep pause froze."""
        self.mode = mode
        if mode == "abort":
            for waiting in (self._queued, self._sleeping, self._held, self._frozen):
                _resolve(waiting, True)
        elif mode == "wait":
            _resolve(self._frozen, False)  # they were running when the keep pause froze them: they finish
        self._notify()

    def resume(self) -> None:
        self.mode = None
        _resolve(self._queued, False)
        _resolve(self._frozen, False)
        self._notify()

    def set_holding(self, on: bool) -> None:
        self.holding = on
        if not on:
            _resolve(self._held, False)
        self._notify()

    async def hang(self) -> None:
        """Wait forever: a request the server never answers, until ``release_hung()`` fails it."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hung.add(fut)
        self._notify()
        try:
            await fut
        finally:
            self._hung.discard(fut)
            self._notify()

    def release_hung(self) -> None:
        """Fail every hung request (ConnectionAbortedError in its handler)."""
        for fut in list(self._hung):
            if not fut.done():
                fut.set_exception(ConnectionAbortedError("hung request released"))

    async def drained(self) -> None:
        """Return once no admitted request is inside (what ``/pause?mode=wait`` waits for)."""
        await self._idle.wait()

    @contextlib.asynccontextmanager
    async def inflight(self) -> AsyncIterator[bool]:
        """Admit a request (queued while paused) and count it inside until the block exits; yields True when an
        abort pause ended its wait in the queue (it never got inside)."""
        loop = asyncio.get_running_loop()
        while self.mode is not None:
            if await self._wait_in(self._queued, loop.create_future()):
                yield True
                return
        self._inside += 1
        self._idle.clear()
        self._notify()
        try:
            yield False
        finally:
            self._inside -= 1
            if self._inside == 0:
                self._idle.set()
            self._notify()

    async def hold(self, delay_s: float) -> bool:
        """Wait ``delay_s``, then while holding, then while a keep pause is in force; True when an abort pause
        ended the wait."""
        loop = asyncio.get_running_loop()
        if delay_s > 0:
            fut: asyncio.Future[bool] = loop.create_future()
            timer = loop.call_later(delay_s, _resolve, {fut}, False)
            try:
                if await self._wait_in(self._sleeping, fut):
                    return True
            finally:
                timer.cancel()
        while self.holding:
            if await self._wait_in(self._held, loop.create_future()):
                return True
        while self.mode == "keep":
            if await self._wait_in(self._frozen, loop.create_future()):
                return True
        return False

    async def _wait_in(self, waiting: set[asyncio.Future[bool]], fut: asyncio.Future[bool]) -> bool:
        waiting.add(fut)
        self._notify()
        try:
            return await fut
        finally:
            waiting.discard(fut)
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _resolve(futures: set[asyncio.Future[bool]], value: bool) -> None:
    for fut in list(futures):
        if not fut.done():
            fut.set_result(value)
