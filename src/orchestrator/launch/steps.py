"""One role instance as a SLURM job step: its ``srun`` line, its start, its exit and its stop.

A step is ``srun --overlap`` on its node(s) (roles may share nodes), named after the instance (``server-1``, so
``squeue -s`` and ``scancel`` find it), with its output in its own log file, appended to across restarts and
requeues (a banner line marks each start). ``srun`` is the only process the runner starts; what runs on the node
is SLURM's. A step is stopped through SLURM: ``scancel --signal=TERM`` reaches every process of the step (srun's
own SIGTERM would kill them at once), then ``--signal=KILL`` once ``timeout_s`` has passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.launch import slurm

log = logging.getLogger(__name__)

Process = asyncio.subprocess.Process


@dataclass
class JobStep:
    name: str  # unique in the job: server-0, env-worker-3, orchestrator, trainer
    role: str
    nodes: tuple[str, ...]
    shell: str  # the command, run by bash on each node (one task per node)
    log_file: Path
    env: Mapping[str, str] = field(default_factory=dict)
    srun_flags: Sequence[str] = ()
    restarts_left: int = 0
    proc: Process | None = None
    starts: int = 0
    started_at: float = 0.0

    def argv(self) -> list[str]:
        n = len(self.nodes)
        return ["srun", "--overlap", f"--job-name={self.name}", f"--nodes={n}", f"--ntasks={n}",
                "--ntasks-per-node=1", f"--nodelist={','.join(self.nodes)}", f"--output={self.log_file}",
                "--open-mode=append", "--kill-on-bad-exit=1", *self.srun_flags, "bash", "-c", self.shell]

    async def start(self, job_id: str) -> None:
        """Start ``srun`` (its own messages go to our stderr, the job's log)."""
        self.starts += 1
        with self.log_file.open("a") as f:
            f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} job {job_id}: {self.name} on {','.join(self.nodes)} "
                    f"(start {self.starts}) ===\n$ {self.shell}\n")
        self.proc = await asyncio.create_subprocess_exec(*self.argv(), env={**os.environ, **self.env},
                                                         stdin=asyncio.subprocess.DEVNULL)
        self.started_at = time.monotonic()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, steps: Mapping[str, str], timeout_s: float, *, signal_first: bool = True) -> None:
        """SIGTERM to every process of the step (unless ``signal_first`` is False: SLURM sent it), SIGKILL after
        ``timeout_s``; then ``srun`` itself by its pid. ``steps``: SLURM's step ids by name."""
        if not self.running:
            return
        step = steps.get(self.name)
        if step is not None and signal_first:
            await slurm.signal_step(step, "TERM")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.wait()
                return
        log.warning("%s did not end within %.0f s of SIGTERM: killing it", self.name, timeout_s)
        if step is not None:
            await slurm.signal_step(step, "KILL")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):
                await self.wait()
                return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        await self.wait()


def describe_exit(code: int) -> str:
    """srun's exit status in words (128 + N: the task was ended by signal N)."""
    if code > 128 and code - 128 in signal.valid_signals():
        return f"was ended by {signal.Signals(code - 128).name} (status {code})"
    return f"exited with status {code}"


def last_lines(path: Path, n: int = 5) -> str:
    """The last ``n`` lines of a log file, for an error that names a step's cause."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").splitlines()[-n:]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in lines if line.strip())
