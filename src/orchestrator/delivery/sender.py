"""``Sender``: what the orchestrator uses of a batch sender, and the one ``send`` every sender shares.

The orchestrator calls ``await sender.send(batch)`` once per step, in order, ``await sender.wait_acked()`` at
the end, reads ``acked`` / ``unacked`` into its state, iterates ``announcements()`` for weight syncs and adds
``metrics()`` to each step's metrics. Every sender keeps its bookkeeping in one ``DeliveryWindow``
(delivery.py) and runs the same ``send``:

1. ``expect``: the step must be the next one (DuplicateStep otherwise);
2. ``_before_send``: the transport's own precondition (a restarted trainer must report first, ...);
3. a step the trainer holds is skipped; one an earlier run delivered durably is adopted (``_delivered_before``);
4. wait while the window is full (``_wait_room``: the bound, with a warning every ``warn_s``; nothing is dropped);
5. ``_deliver``: encode and send / write; what it returns is kept for a resend until acknowledged;
6. ``_handed_over``: a transport that sends from the window (zmq) waits until the step is out.

Sends run one at a time, in call order. Subclasses wake waiters with ``_notify()`` whenever the trainer's state
changes (an acknowledgement, a rank that connects). Every wait logs one line every ``warn_s`` (the liveness
bound, ``monitor.stall_warn_s``) saying what it waits for, counted from when it began: messages that change
nothing (a trainer's status every second) do not restart the count. ``checkpoint_wanted(policy)`` is called
while the orchestrator waits for weights: a link that can asks the trainer for its newest checkpoint, and
each says where checkpoints come from, for the orchestrator's stall line. Importable without verifiers.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from orchestrator.contracts.checkpoints import Checkpoint
from orchestrator.delivery.window import DeliveryWindow

log = logging.getLogger(__name__)

P = TypeVar("P")


class Step(Protocol):
    """What a sender sends once per step: a ``Batch`` (columns), or a step manifest (the direct data plane)."""

    @property
    def step(self) -> int: ...


class Sender(abc.ABC, Generic[P]):
    """A batch sender (see the module docstring); ``P`` is what ``unacked`` keeps per step."""

    kind = "?"  # the [transport] kind, in metrics

    def __init__(self, address: str, bound: int, warn_s: float, *, keep: int = 0, acked_before: int = -1) -> None:
        self._address = address
        self.window: DeliveryWindow[P] = DeliveryWindow(bound, keep=keep, acked_before=acked_before)
        self.warn_s = warn_s
        self.bytes_sent = 0
        self.waiting = False  # true while a send waits for room (the bound)
        self._changed = asyncio.Event()  # set when the trainer's state changes; waiters re-check
        self._sending = asyncio.Lock()  # concurrent sends go one at a time, in call order

    @property
    def address(self) -> str:
        """Where the trainer finds the batches (a ZMQ address or a directory)."""
        return self._address

    @property
    def acked(self) -> int:
        """The last step the trainer acknowledged (-1 for none)."""
        return self.window.acked

    @property
    def unacked(self) -> Mapping[int, P | None]:
        """Steps sent and not yet acknowledged, oldest first, with what a resend needs."""
        return self.window.unacked

    @property
    def skipped(self) -> list[int]:
        """Steps not sent because the trainer had them (or an earlier run delivered them)."""
        return self.window.skipped

    @property
    def next_step(self) -> int | None:
        return self.window.next_step

    async def send(self, batch: Step) -> bool:
        """Send one step (True), or skip it (False) when the trainer already has it; waits, never drops, while
        the window is full (see the module docstring)."""
        async with self._sending:
            step = batch.step
            self.window.expect(step)
            await self._before_send(step)
            if self.window.holds(step):
                log.info("step %d not sent: the trainer at %s already has steps up to %d", step, self.address,
                         self.window.acked)
                self.window.skip(step)
                return False
            if await self._delivered_before(step):
                log.info("step %d not sent again: an earlier run delivered it to %s", step, self.address)
                self.window.adopt(step)
                self._recorded(step)
                return False
            await self._wait_room(step)
            payload, nbytes = await self._deliver(batch)
            self.window.record(step, payload)
            self.bytes_sent += nbytes
            self._recorded(step)
            await self._handed_over(step)
            return True

    async def wait_acked(self) -> None:
        """Wait until the trainer has acknowledged every step sent (warning every ``warn_s``)."""
        if self.window.unacked:
            await self._wait(lambda: not self.window.unacked, max(self.window.unacked),
                             "has not acknowledged the last steps")

    @abc.abstractmethod
    def announcements(self, marker_dir: Path | None = None) -> AsyncIterator[Checkpoint]:
        """Checkpoints the trainer makes ready, for weight syncs (``marker_dir``: from marker files)."""

    def checkpoint_wanted(self, policy: int) -> str:
        """The orchestrator waits for weights of step >= ``policy``: ask the trainer for its newest checkpoint
        where the link can, and say where checkpoints come from (a clause for the orchestrator's stall line)."""
        return f"checkpoints come from the trainer at {self.address}"

    def run_finished(self) -> None:
        """The run has trained its last step and asks nothing more: a link that can tells the trainer (one that
        serves weight transfers stops waiting for a request)."""

    def metrics(self) -> dict[str, Any]:
        """Added to each step's metrics: the link's state after the step's send."""
        return {"transport": {"kind": self.kind, "acked": self.acked, "unacked": len(self.window.unacked),
                              "skipped": len(self.window.skipped), "sent_mb": round(self.bytes_sent / 2**20, 3)}}

    # ------------------------------------------------------------------------------------- for subclasses

    async def _before_send(self, step: int) -> None:
        """Wait for whatever the transport needs before it can tell whether the trainer holds ``step``."""

    async def _delivered_before(self, step: int) -> bool:
        """Whether an earlier run delivered ``step`` durably (it is adopted, not sent again)."""
        return False

    async def _wait_room(self, step: int) -> None:
        """Wait while ``bound`` steps are unacknowledged."""
        self.waiting = True
        try:
            await self._wait(lambda: not self.window.full, step,
                             f"has not acknowledged steps {sorted(self.window.unacked)}")
        finally:
            self.waiting = False

    @abc.abstractmethod
    async def _deliver(self, batch: Any) -> tuple[P | None, int]:
        """Send ``batch`` (a ``Batch``; a transport that carries step manifests takes those too); what to keep
        for a resend, and the bytes sent."""

    def _recorded(self, step: int) -> None:
        """``step`` is in the window (sent or adopted): e.g. acknowledge a durable write at once."""

    async def _handed_over(self, step: int) -> None:
        """``step`` was recorded: wait until it is out (for a transport that sends from the window)."""

    def _notify(self) -> None:
        self._changed.set()

    async def _wait(self, ready: Callable[[], bool], step: int, why: str | Callable[[], str]) -> None:
        """Wait until ``ready()``, re-checking on every ``_notify``; warn every ``warn_s`` from the start of the
        wait (however often it is woken meanwhile) that ``step`` waits because the trainer ``why`` (a callable:
        said as it is then)."""
        loop = asyncio.get_running_loop()
        t0 = warned = loop.time()
        while not ready():
            self._changed.clear()
            try:
                async with asyncio.timeout(max(warned + self.warn_s - loop.time(), 0.0)):
                    await self._changed.wait()
            except TimeoutError:
                warned = loop.time()
                log.warning("step %d waits: the trainer at %s %s (%.0f s so far)", step, self.address,
                            why() if callable(why) else why, warned - t0)

