"""Bad input at the edges: each is one message naming the cause, with the exit status docs/operations.md promises
(2: a config or usage error, before anything starts; 1: an error a component names), never a traceback."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest

from orchestrator.sinks.jsonl import OutputError
from orchestrator.state import STATE_FILE, OrchestratorState, StateError, save_state
from orchestrator.steps.outputs import StepOutputs
from orchestrator.testing.steps import rollout_row

JOB = """[run]
name = "r"
output_dir = "{out}"
[inference]
servers = ["http://127.0.0.1:9/v1"]
[scheduler]
batch_size = 8
[[env]]
taskset = "orchestrator-arithmetic"
group_size = {group_size}
"""


def job(tmp: Path, out: Path | None = None, group_size: int = 4) -> str:
    path = tmp / "job.toml"
    path.write_text(JOB.format(out=out or tmp / "out", group_size=group_size))
    return str(path)


def state_file(tmp: Path, **fields: object) -> str:
    """A job whose output directory holds a state file with ``fields`` over a valid state's."""
    out = tmp / "out"
    out.mkdir()
    raw = {"version": 2, "run": "r", "next_step": 3, "acked_step": 2, "policy_step": 2, "policy_path": None,
           "scheduler": {}, "sampling": {}, **fields}
    (out / STATE_FILE).write_bytes(msgpack.packb(raw))
    return job(tmp)


def garbage_state(tmp: Path) -> str:
    (tmp / "out").mkdir()
    (tmp / "out" / STATE_FILE).write_bytes(b"\xc1junk")
    return job(tmp)


def a_directory(tmp: Path) -> str:
    (tmp / "adir").mkdir()
    return str(tmp / "adir")


def binary(tmp: Path) -> str:
    (tmp / "job.toml").write_bytes(bytes(range(128, 256)) * 4)
    return str(tmp / "job.toml")


def torn_metrics(tmp: Path) -> str:
    (tmp / "metrics.jsonl").write_bytes(b'{"step": 0, "reward_mean": {"a": 0.5}}\n{"step": 1, "rew')
    return str(tmp)


def under_a_file(tmp: Path) -> str:
    (tmp / "file").write_text("x")
    return job(tmp, out=tmp / "file" / "out")


Case = tuple[str, Callable[[Path], list[str]], int, str]
CASES: list[Case] = [
    ("config is a directory", lambda t: ["check", a_directory(t)], 2, "a directory, not a TOML file"),
    ("config is binary", lambda t: ["check", binary(t)], 2, "not a text file"),
    ("group_size 1 trains nothing", lambda t: ["check", job(t, group_size=1)], 2, "nothing would train"),
    ("receive: not an address", lambda t: ["receive", "not-an-address"], 2, "expected tcp://HOST:PORT or ipc://PATH"),
    ("receive: journal is a directory", lambda t: ["receive", f"ipc://{t}/x.sock", "--journal", a_directory(t)], 2,
     "is a directory; give a file path"),
    ("env-worker: garbage address", lambda t: ["env-worker", "--connect", "garbage"], 2, "expected tcp://HOST:PORT"),
    ("env-worker: tcp without a port", lambda t: ["env-worker", "--connect", "tcp://host"], 2, "got 'tcp://host'"),
    ("output dir under a file", lambda t: ["run", under_a_file(t)], 1, "cannot create it (Not a directory)"),
    ("state: garbage bytes", lambda t: ["run", garbage_state(t), "--resume"], 1, "corrupt state file"),
    ("state: hand-edited type", lambda t: ["run", state_file(t, acked_step="two"), "--resume"], 1,
     "acked_step = 'two' is not an integer"),
    ("state: no state to resume", lambda t: ["run", job(t), "--resume"], 1, "no saved state to resume from"),
    ("report: torn last line", lambda t: ["report", torn_metrics(t), "--out", str(t / "plots")], 0,
     "skipping the last line, cut short"),
]


@pytest.mark.parametrize(("name", "args", "code", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_message_with_the_promised_exit_status(tmp_path: Path, name: str,
                                                                args: Callable[[Path], list[str]], code: int,
                                                                message: str) -> None:
    argv = args(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "HOME": str(tmp_path / "home")}, check=False)
    assert proc.returncode == code, (name, proc.stderr[-2000:])
    assert message in proc.stderr, (name, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_a_full_disk_under_the_outputs_is_a_message_naming_the_file(tmp_path: Path) -> None:
    outputs = StepOutputs(tmp_path)
    outputs.metrics_path.symlink_to("/dev/full")  # every write: ENOSPC
    full = r"metrics\.jsonl: cannot write the run's outputs \(No space left on device\)"
    with pytest.raises(OutputError, match=full):
        outputs.write([rollout_row()], {"step": 0})


def test_a_failed_state_save_is_a_message_and_leaves_the_old_state_and_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_state(tmp_path, OrchestratorState(run="r", next_step=1))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StateError, match=r"cannot save the run's state \(No space left on device\)"):
        save_state(tmp_path, OrchestratorState(run="r", next_step=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE_FILE]
