"""What a person sees while a job runs, the same for ``orchestrator run`` and ``orchestrator demo``.

``StepProgress`` writes to stdout (the log stays on stderr):

- on a terminal, one progress bar redrawn in place: ``step 3/10``, the bar, each environment's mean reward,
  failures and throughput, the elapsed time. Log lines printed on the same terminal go above the bar instead of
  through it (while the bar is shown, the logging handlers that write to stderr write through rich's proxy);
- otherwise (a pipe, a file, CI), one plain line per step with the same fields, flushed at once.

::

    with StepProgress(total=cfg.run.max_steps, done=orch.state.acked_step + 1) as progress:
        orch.on_step = progress.on_step     # called on the event loop after each step: cheap
        await orch.run()
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

STARTING = "starting env workers"


def describe(m: Mapping[str, Any]) -> str:
    """A step's metrics row as the progress line shows it: mean reward per environment, failures, rollouts/s."""
    rewards = " ".join(f"{env}={r:.2f}" for env, r in m["reward_mean"].items()) or "-"
    failed = f" | {m['failed']} failed" if m.get("failed") else ""
    return f"reward {rewards}{failed} | {m['rollouts_per_s']:.0f} rollouts/s"


class StepProgress:
    """Progress of steps ``done`` .. ``total - 1``; ``terminal`` None: whether ``file`` (stdout) is a TTY."""

    def __init__(self, total: int, done: int = 0, *, file: TextIO | None = None, terminal: bool | None = None
                 ) -> None:
        self.file = sys.stdout if file is None else file
        self.terminal = self.file.isatty() if terminal is None else terminal
        self.total = total
        self.done = done
        self.console = Console(file=self.file, force_terminal=self.terminal,
                               width=None if self.terminal else 160)  # plain output: no wrapping at 80
        self._t0 = time.monotonic()
        self._bar: Progress | None = None
        self._task: Any = None
        self._handlers: list[tuple[logging.StreamHandler[Any], Any]] = []

    def __enter__(self) -> StepProgress:
        self._t0 = time.monotonic()
        if not self.terminal:
            return self
        stderr = sys.stderr
        # stderr goes above the bar only when it is a terminal too (2> file keeps the log in the file)
        self._bar = Progress(TextColumn("[bold]step {task.completed}/{task.total}"), BarColumn(),
                             TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console,
                             redirect_stdout=False, redirect_stderr=stderr.isatty())
        self._task = self._bar.add_task(STARTING, total=self.total, completed=self.done)
        self._bar.start()
        if sys.stderr is not stderr:  # rich put its proxy there: log handlers holding the real stderr use it too
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is stderr:
                    self._handlers.append((handler, handler.setStream(sys.stderr)))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers.clear()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def on_step(self, m: Mapping[str, Any]) -> None:
        """After step ``m["step"]`` (its metrics row): move the bar, or print its line."""
        self.done = int(m["step"]) + 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=describe(m))
            return
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self._t0))
        print(f"step {self.done}/{self.total} | {describe(m)} | {elapsed}", file=self.file, flush=True)
