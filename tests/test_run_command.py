"""What a person sees from `orchestrator run`: a progress bar on a terminal, plain lines otherwise (the same code
as the demo, orchestrator.progress); and a clean end: no library warnings, no socket files left behind."""

from __future__ import annotations

import asyncio
import fcntl
import io
import logging
import os
import re
import stat
import struct
import termios
from pathlib import Path
from typing import Any

import pytest

from orchestrator import ipc
from orchestrator.delivery.zmq_link import BatchSender
from orchestrator.progress import StepProgress, describe
from orchestrator.testing.jobs import ARITHMETIC, write_job_toml
from orchestrator.testing.procs import logged, orchestrator_process, wait_until, write_job
from orchestrator.testing.sim import sim_cluster, sim_servers
from orchestrator.trainer.reference import ReferenceTrainer
from orchestrator.workers.quiet import (
    ENDED_ROLLOUT_REQUEST,
    FAILED_MODEL_CALL,
    INTERCEPTION_LOGGER,
    DemotedWarnings,
)

PIPE = asyncio.subprocess.PIPE
# every line on stderr is a log line of ours (the orchestrator's or its env workers'): a library's warning,
# a traceback or a bare print would not match
OUR_LOG_LINE = re.compile(r"\d\d:\d\d:\d\d (DEBUG|INFO|WARNING|ERROR|CRITICAL) +orchestrator[.\w]*: ")


def metrics(step: int, rewards: dict[str, float], failed: int = 0) -> dict[str, Any]:
    return {"step": step, "reward_mean": rewards, "failed": failed, "rollouts_per_s": 12.4}


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with StepProgress(3, file=out) as progress:  # a StringIO is no TTY
        assert not progress.terminal
        progress.on_step(metrics(0, {"arith": 0.5, "guess": 0.125}))
        progress.on_step(metrics(1, {"arith": 0.75}, failed=2))
    lines = out.getvalue().splitlines()
    assert [line.rsplit(" | ", 1)[0] for line in lines] == [
        "step 1/3 | reward arith=0.50 guess=0.12 | 12 rollouts/s",
        "step 2/3 | reward arith=0.75 | 2 failed | 12 rollouts/s"]
    assert all(re.fullmatch(r"\d\d:\d\d:\d\d", line.rsplit(" | ", 1)[1]) for line in lines)  # elapsed
    assert "\x1b" not in out.getvalue()


def test_a_bar_on_a_terminal_resumed_run_counts_from_its_first_step() -> None:
    out = io.StringIO()
    with StepProgress(10, done=4, file=out, terminal=True) as progress:
        progress.on_step(metrics(4, {"arith": 0.5}))
    text = out.getvalue()
    assert "step 5/10" in text
    assert "━" in text  # the bar
    assert describe(metrics(4, {"arith": 0.5})) in text
    assert "\x1b[" in text  # drawn in place


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_log_lines_go_above_the_bar_and_the_handler_gets_its_stream_back(monkeypatch: pytest.MonkeyPatch) -> None:
    err = Terminal()  # a terminal on stderr too
    monkeypatch.setattr("sys.stderr", err)
    handler = logging.StreamHandler(err)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        out = io.StringIO()
        with StepProgress(2, file=out, terminal=True):
            assert handler.stream is not err  # rich's proxy: printed above the bar, on the bar's console
            logging.getLogger("orchestrator.test").warning("a log line during the run")
        assert handler.stream is err
    finally:
        root.removeHandler(handler)
    assert "a log line during the run" in out.getvalue()
    assert err.getvalue() == ""


@pytest.mark.parametrize("demoted", [(ENDED_ROLLOUT_REQUEST, ()),
                                     (FAILED_MODEL_CALL, ("r1", "ProviderError", "connection refused"))])
def test_only_verifiers_straggler_and_failed_call_warnings_are_demoted(demoted: tuple[str, tuple[str, ...]]
                                                                       ) -> None:
    demote = DemotedWarnings()
    logger = logging.getLogger(INTERCEPTION_LOGGER)

    def record(level: int, message: str) -> logging.LogRecord:
        return logger.makeRecord(INTERCEPTION_LOGGER, level, __file__, 1, message, args if message == msg else (),
                                 None)

    msg, args = demoted

    other = record(logging.WARNING, "interception removed provider content")
    assert demote.filter(other)
    assert other.levelname == "WARNING"
    quieted = record(logging.WARNING, msg)
    previous = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert not demote.filter(quieted)
        logger.setLevel(logging.DEBUG)
        quieted = record(logging.WARNING, msg)
        assert demote.filter(quieted)
        assert quieted.levelname == "DEBUG"
    finally:
        logger.setLevel(previous)


async def test_the_batch_sender_removes_its_socket_files(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/run/trainer.sock"
    async with BatchSender.open(address):
        assert stat.S_ISSOCK((tmp_path / "run" / "trainer.sock").stat().st_mode)
        assert stat.S_ISSOCK((tmp_path / "run" / "trainer.sock.ckpt").stat().st_mode)
    assert list((tmp_path / "run").iterdir()) == []
    assert ipc.ipc_path("tcp://127.0.0.1:5555") is None


def socket_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if stat.S_ISSOCK(p.lstat().st_mode)]


async def run_job(tmp_path: Path, stdout: Any, data_plane: str, steps: int = 2) -> tuple[int, str, str, Path]:
    """``orchestrator run`` (INFO log) for ``steps`` steps against an in-process sim server and trainer; its exit
    status, its stdout (when ``stdout`` is PIPE) and stderr, its output directory."""
    env = {**os.environ, "HOME": str(tmp_path / "home"), "TERM": "xterm-256color", "COLUMNS": "120"}
    async with sim_servers(1) as servers:
        cfg, out = write_job(tmp_path, servers[0].url, steps, "progress", data_plane)
        trainer = ReferenceTrainer(f"ipc://{out}/trainer.sock", max_steps=steps, checkpoint_dir=tmp_path / "ckpt")
        async with (orchestrator_process("run", str(cfg), log_level="INFO", stdout=stdout, stderr=PIPE,
                                         env=env) as run,
                    asyncio.timeout(400), asyncio.TaskGroup() as tg):  # a bound for a loaded machine, not a pace
            tg.create_task(trainer.run())
            printed, err = await run.communicate()
    assert run.returncode is not None
    return run.returncode, (printed or b"").decode(), err.decode(), out


def assert_clean_end(code: int, stderr: str, out: Path) -> None:
    assert code == 0, stderr
    strays = [line for line in stderr.splitlines() if line.strip() and not OUR_LOG_LINE.match(line)]
    assert strays == [], "lines on stderr that are not our log lines"
    assert "unauthorized request" not in stderr
    assert "PyTorch was not found" not in stderr
    assert socket_files(out) == []
    assert (out / "metrics.jsonl").read_bytes().count(b"\n") == 2


@pytest.mark.slow
@pytest.mark.timeout(450)
async def test_run_prints_plain_lines_to_a_pipe_and_ends_clean(tmp_path: Path, data_plane: str) -> None:
    code, stdout, stderr, out = await run_job(tmp_path, PIPE, data_plane)
    assert_clean_end(code, stderr, out)
    lines = stdout.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2"]
    assert all(" | reward orchestrator-arithmetic=" in line and " rollouts/s | " in line for line in lines)


@pytest.mark.slow
@pytest.mark.timeout(450)
async def test_run_draws_the_bar_on_a_terminal(tmp_path: Path, data_plane: str) -> None:
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    screen = asyncio.create_task(asyncio.to_thread(read_all, leader))
    try:
        code, _, stderr, out = await run_job(tmp_path, follower, data_plane)
    finally:
        os.close(follower)  # the run and its workers have exited: the terminal's last writer goes
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", (await screen).decode(errors="replace"))
    assert_clean_end(code, stderr, out)
    assert "step 2/2" in text
    assert "━" in text
    assert "reward orchestrator-arithmetic=" in text


def read_all(fd: int) -> bytes:
    """Everything written to a pseudo-terminal, until its last writer closes it (EIO on Linux)."""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks)


def write_server_death_job(directory: Path, urls: list[str], steps: int) -> Path:
    """Arithmetic on ``urls`` for ``steps`` steps, every step from policy 0 (the trainer announces no weights)."""
    return write_job_toml(
        directory, run={"name": "server-death", "max_steps": steps}, inference={"servers": urls},
        scheduler={"batch_size": 16, "max_inflight": 32, "max_async_level": steps, "max_off_policy_steps": steps},
        pipeline={"gates": []},
        # a server's failure lines: one per stall_warn_s (a busy machine may spread them over seconds)
        monitor={"stall_warn_s": 300}, env=[ARITHMETIC])


@pytest.mark.slow
@pytest.mark.timeout(450)
async def test_a_server_that_dies_is_one_event_in_the_log(tmp_path: Path) -> None:
    """The issue's case: a server killed with rollouts in flight printed verifiers' "model call failed" once per
    failed call (27 lines for one kill), besides a line of ours per failed rollout, and a dropped group's line
    did not say why. Now the log has the first failure, the server's eviction, and dropped groups with why."""
    steps, log, out = 4, tmp_path / "run.log", tmp_path / "out"
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    async with sim_cluster(2) as cluster:
        cfg = write_server_death_job(tmp_path, cluster.urls, steps)
        trainer = ReferenceTrainer(f"ipc://{out}/trainer.sock", max_steps=steps, announce=False)
        async with (orchestrator_process("run", str(cfg), log_level="INFO", log=log, env=env) as run,
                    asyncio.timeout(400), asyncio.TaskGroup() as tg):  # a bound for a loaded machine, not a pace
            tg.create_task(trainer.run())
            await wait_until(lambda: len(trainer.received) >= 1, 300, "the first step", alive=run)
            cluster.set_faults(0, hold=True)  # its requests stay in flight until it dies
            await asyncio.wait_for(cluster[0].gate.wait_until(lambda gate: gate.running >= 8), 300)
            await cluster.kill(0)
            assert await run.wait() == 0
    lines = logged(log, "")
    assert logged(log, f"inference server {cluster.urls[0]} leaves rotation"), lines
    assert logged(log, "model call failed") == []  # verifiers' line per failed call: DEBUG
    ours = [line for line in lines if re.search(r"WARNING .*: rollout g\d+-\d+ \(.*\) failed: ", line)]
    assert len(ours) == 1, ours  # the first; the rest at DEBUG (the eviction line names the server)
    dropped = [line for line in lines if " dropped: " in line]
    assert all(re.search(r"rollouts failed: \w+ x\d+", line) for line in dropped), dropped
