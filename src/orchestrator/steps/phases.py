"""``StepPipeline``: the phases of one step, in order. The orchestrator (app.py) runs it for every step, and the
perf replay (scripts/perf/_steplib.py) runs the same object, so a replay measures exactly what a step costs.

1. ``advantage``, ``filter``, ``assemble``: the StepBuilder's phases (steps/boundary.py), blocking. Direct mode
   builds a step manifest instead (the orchestrator's ``build``; its phases are timed by the builder).
2. ``send``: the host's send (the sender's ``send``; the replay also waits for its receiver), on the loop.
3. the host's ``sent``: the step's bookkeeping after the send, and the extra metrics of the step.
4. ``dump``: ``write_dump`` (blocking), when asked and there is a batch to dump.
5. the host's ``samples``: the samples table's rows (the orchestrator, when due).
6. ``gc``: ``gc.collect`` + ``malloc_trim`` (blocking), once the step's groups and batch are let go.
7. ``metrics``: ``step_metrics`` (pandas, blocking).
8. ``write``: the host's ``write`` (blocking): rows and metrics out (rollouts.jsonl, the sinks, the state).

Every blocking phase runs through the host's ``phase`` (the orchestrator: its one step thread; the replay: a
worker thread or inline, timed and profiled). Each phase's wall time goes in the step's ``phase_s``: in the
metrics row except ``write`` (timed after the row is written; it is in the step's log line).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from orchestrator.contracts.rows import RolloutRow, dropped_rows
from orchestrator.contracts.wire import Batch
from orchestrator.lagmon import LagStats
from orchestrator.memory import malloc_trim, rss_mb
from orchestrator.steps.boundary import StepBuilder, StepResult
from orchestrator.steps.dump import write_dump
from orchestrator.steps.outputs import step_metrics

T = TypeVar("T")


class StepHost(Protocol):
    """What the pipeline asks of the one that runs it (the orchestrator; the perf replay)."""

    async def phase(self, name: str, fn: Callable[[], T]) -> T:
        """Run the blocking phase ``name`` (``fn``) off the loop, or as the host measures it."""

    async def send(self, batch: Any) -> bool:
        """Send the step's batch (or manifest): False when it was not sent (the trainer had it)."""

    def sent(self, step: int, result: StepResult[Any], sent: bool) -> dict[str, Any]:
        """After the send: the step's bookkeeping; returns the extra fields of its metrics."""

    def lag(self) -> LagStats:
        """The event loop's lag over the step so far."""

    async def samples(self, step: int, rows: list[RolloutRow], shown: Sequence[Any]) -> list[dict[str, Any]]:
        """The samples table's rows of this step (none when not due)."""

    def write(self, step: int, rows: list[RolloutRow], metrics: dict[str, Any],
              samples: list[dict[str, Any]]) -> None:
        """Blocking: the step's rows, metrics and samples out."""


@dataclass
class Built:
    """A built step: what is sent, the groups the dump and the samples table read, the batch a dump writes."""

    result: StepResult[Any]
    shown: Sequence[Any]
    dumped: Batch | None


Build = Callable[[int, Sequence[Any], Sequence[Any], dict[str, float]], Awaitable[Built]]


class StepPipeline:
    """Runs one step's phases in order (see the module docstring)."""

    def __init__(self, builder: StepBuilder, host: StepHost, *, config_toml: str | None = None) -> None:
        """``config_toml``: written into each dump (the orchestrator's job config; a replay has none)."""
        self.builder = builder
        self.host = host
        self.config_toml = config_toml

    async def build(self, step: int, groups: Sequence[Any], dropped: Sequence[Any], phase_s: dict[str, float]
                    ) -> Built:
        """Phases ``advantage``, ``filter`` (the rows of ``dropped`` groups after the step's own), ``assemble``."""
        b = self.builder
        advantages = await self._timed(phase_s, "advantage", lambda: b.advantages(groups))

        def filtered() -> tuple[list[RolloutRow], list[Any]]:
            rows, trained = b.filter(step, groups, advantages)
            return rows + dropped_rows(step, dropped), trained

        rows, trained = await self._timed(phase_s, "filter", filtered)
        batch = await self._timed(phase_s, "assemble", lambda: b.assemble(step, trained))
        return Built(b.result(batch, rows, phase_s, groups, trained), groups, batch)

    async def run(self, step: int, take: Callable[[int], Awaitable[tuple[Sequence[Any], Sequence[Any]]]], *,
                  dump_to: Path | None = None, build: Build | None = None) -> dict[str, Any]:
        """Every phase of step ``step``; its metrics row. ``take(step)``: the step's groups and the dropped
        groups whose rows it writes (the orchestrator waits for them: phase ``wait``); ``dump_to``: dump the step
        there; ``build``: instead of ``self.build`` (direct mode's manifest)."""
        t0 = time.perf_counter()
        groups, dropped = await take(step)
        phase_s = {"wait": time.perf_counter() - t0}
        built = await (build or self.build)(step, groups, dropped, phase_s)
        phase_s.update(built.result.phase_s)
        t = time.perf_counter()
        sent = await self.host.send(built.result.batch)
        phase_s["send"] = time.perf_counter() - t
        rows = built.result.rows
        if dump_to is not None and built.dumped is not None:
            shown, dumped = built.shown, built.dumped
            await self._timed(phase_s, "dump", lambda: write_dump(
                dump_to, step, shown, dumped, rows, run=self.builder.run, vocab_size=self.builder.vocab_size,
                config_toml=self.config_toml))
            del shown, dumped
        extra = self.host.sent(step, built.result, sent)
        lag = self.host.lag()
        samples = await self.host.samples(step, rows, built.shown)
        del groups, dropped, built  # the step's column memory goes now (this frame holds the only references)
        await self._timed(phase_s, "gc", _collect)
        metrics = await self._timed(phase_s, "metrics", lambda: step_metrics(
            step, rows, phase_s=phase_s, lag=lag, rss_mb=rss_mb(), wall_s=time.perf_counter() - t0, extra=extra))
        metrics["phase_s"]["metrics"] = round(phase_s["metrics"], 6)
        await self._timed(phase_s, "write", lambda: self.host.write(step, rows, metrics, samples))
        metrics["phase_s"]["write"] = round(phase_s["write"], 6)  # in the log line; the file has the rest
        return metrics

    async def _timed(self, phase_s: dict[str, float], name: str, fn: Callable[[], T]) -> T:
        t = time.perf_counter()
        out = await self.host.phase(name, fn)
        phase_s[name] = time.perf_counter() - t
        return out


def _collect() -> None:
    gc.collect()
    malloc_trim()
