"""Running ``orchestrator`` commands as real processes in tests: start, wait for a condition, find leftovers.

``process_state(pid)`` (from orchestrator.procs) says whether a signal has taken effect: SIGSTOP has stopped a
process once it says ``T``.

Every process started here is stopped by its pid when its context exits (SIGKILL if it is still running).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from orchestrator.procs import process_state
from orchestrator.testing.jobs import ARITHMETIC, Section, toml_text
from orchestrator.workers.zygote import NAME as WARM_NAME

__all__ = ["env_workers", "logged", "orchestrator_process", "process_state", "processes_mentioning", "python_process",
           "unix_connections", "wait_until", "write_job"]

Process = asyncio.subprocess.Process


@contextlib.asynccontextmanager
async def python_process(*argv: str, **popen: Any) -> AsyncIterator[Process]:
    """``python ARGV...`` (this interpreter); killed by its pid on exit if still running. ``popen`` goes to
    ``asyncio.create_subprocess_exec``."""
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv, **popen)
    try:
        yield proc
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()


@contextlib.asynccontextmanager
async def orchestrator_process(*args: str, log_level: str | None = None, log: Path | None = None,
                               **popen: Any) -> AsyncIterator[Process]:
    """``python -m orchestrator --log-level LEVEL ARGS...``; killed by pid on exit if still running.
    ``log_level`` defaults to $ORCHESTRATOR_TEST_LOG_LEVEL, else WARNING; ``popen`` (``stdout``, ``stderr``,
    ``env``...) goes to ``asyncio.create_subprocess_exec``. ``log``: its stderr (the log and any error) goes
    to that file (appended), for a test to read (``logged``)."""
    log_level = log_level or os.environ.get("ORCHESTRATOR_TEST_LOG_LEVEL", "WARNING")
    with contextlib.ExitStack() as files:
        if log is not None:
            popen["stderr"] = files.enter_context(open(log, "ab"))  # noqa: ASYNC230 - a local file
        async with python_process("-m", "orchestrator", "--log-level", log_level, *args, **popen) as proc:
            files.close()  # the child has its own copy of the log's fd
            yield proc


async def wait_until(ready: Callable[[], bool], timeout_s: float, what: str, *, alive: Process | None = None,
                     poll_s: float = 0.1) -> None:
    """Poll ``ready`` until it holds; AssertionError naming ``what`` after ``timeout_s``, or at once if
    ``alive`` exits first."""
    loop = asyncio.get_running_loop()  # its clock: a test on a virtual one (testing.clock) waits in virtual time
    deadline = loop.time() + timeout_s
    while not ready():
        if alive is not None and alive.returncode is not None:
            raise AssertionError(f"waiting for {what}: process {alive.pid} exited with {alive.returncode}")
        if loop.time() > deadline:
            raise AssertionError(f"waiting for {what}: not within {timeout_s:.0f} s")
        await asyncio.sleep(poll_s)


def logged(log: Path, text: str) -> list[str]:
    """The lines of ``log`` (an ``orchestrator_process(log=...)`` file) that contain ``text``."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    return [line for line in lines if text in line]


def env_workers(text: str) -> list[int]:
    """Pids of the env workers whose command line contains ``text`` (e.g. a run's worker socket path): those of
    ``processes_mentioning``, but the hub's warm process, which forks them with the same command line."""
    return [pid for pid in processes_mentioning(text) if _comm(pid) != WARM_NAME]


def _comm(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes whose command line contains ``text`` (e.g. a run's worker socket path)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if text.encode() in cmdline and stat.rsplit(")", 1)[-1].split()[0] != "Z":  # zombies have ended
            pids.append(int(d.name))
    return pids


def unix_connections(path: str | Path) -> int:
    """Connections to the Unix socket ``path`` (an ``ipc://`` address without its scheme) that the process which
    bound it still holds open; 0 once it has closed every peer's connection (e.g. after the peer died)."""
    held = 0
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()  # Num RefCount Protocol Flags Type St Inode [Path]; St 03: connected
        if len(fields) == 8 and fields[7] == str(path) and fields[5] == "03":
            held += 1
    return held


def write_job(directory: Path, url: str, steps: int, name: str, data_plane: str = "through", *, workers: int = 1,
              env: Section = ARITHMETIC, **more: Section | Sequence[Section]) -> tuple[Path, Path]:
    """A small job (``env``: arithmetic unless said, ``workers`` env workers, 8 rollouts a step) for runs as real
    processes: writes ``directory/job.toml`` (``testing.jobs``); returns it and the run's output directory.
    ``data_plane``: its ``transport.data_plane`` (the transport is kind = "zmq", keep_acked = 0, so both apply);
    ``more``: more sections (``monitor={...}``)."""
    out, cfg = directory / "out", directory / "job.toml"
    cfg.write_text(toml_text(
        run={"name": name, "output_dir": out, "max_steps": steps}, inference={"servers": [url]},
        scheduler={"batch_size": 8, "max_inflight": 8},
        pipeline={"gates": []},  # every finished group trains: gates are not what this test is about
        transport={"data_plane": data_plane}, env=[{**env, "workers": workers}], **more))
    return cfg, out
