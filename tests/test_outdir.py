"""The output directory: one orchestrator at a time; after a resume the rows describe what the trainer trained;
a resume that would change what is sampled is refused, naming the change."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from pathlib import Path

import orjson
import pytest

from orchestrator.config import load_config
from orchestrator.outdir import LOCK_FILE, OutputDir, OutputDirInUse, identity_changes, sampling_identity
from orchestrator.state import StateError, load_state, save_state
from orchestrator.testing.jobs import Section, write_job_toml
from orchestrator.testing.procs import orchestrator_process, write_job
from orchestrator.testing.sim import sim_process
from orchestrator.trainer.reference import read_journal

BOUND_S = 240  # hang guard only


def config(tmp_path: Path, *more_envs: Section) -> Path:
    """Arithmetic (its defaults: groups of 8), then ``more_envs``, against a closed port."""
    return write_job_toml(tmp_path, run={"name": "r"}, inference={"servers": ["http://127.0.0.1:9/v1"]},
                          scheduler={"batch_size": 8}, env=[{"taskset": "orchestrator-arithmetic"}, *more_envs])


def test_a_second_orchestrator_on_the_directory_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path))
    first = OutputDir.open(cfg, resume=False)
    try:
        with pytest.raises(OutputDirInUse, match=f"in use by another orchestrator \\(pid {os.getpid()}, run 'r'\\)"):
            OutputDir.open(cfg, resume=False)
        assert (tmp_path / "out" / LOCK_FILE).exists()
    finally:
        first.close()
    OutputDir.open(cfg, resume=False).close()  # released with its holder


def test_a_fresh_run_clears_the_old_outputs_only_once_it_holds_the_lock(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_bytes(b'{"step": 0}\n')
    first = OutputDir.open(cfg, resume=False)
    (tmp_path / "out" / "metrics.jsonl").write_bytes(b'{"step": 0}\n')  # the first run's output
    with pytest.raises(OutputDirInUse):
        OutputDir.open(cfg, resume=False)
    assert (tmp_path / "out" / "metrics.jsonl").read_bytes() == b'{"step": 0}\n'  # untouched by the refused one
    first.close()


@pytest.mark.parametrize(("change", "named"), [
    ("seed", "run.seed: 0 -> 7"),
    ("group_size", "env 'orchestrator-arithmetic' group_size: 8 -> 4"),
    ("another env", "env: ['orchestrator-arithmetic'] -> "),
])
def test_a_resume_that_changes_what_is_sampled_is_refused_naming_it_unless_forced(
        tmp_path: Path, change: str, named: str) -> None:
    cfg = load_config(config(tmp_path))
    fresh = OutputDir.open(cfg, resume=False)
    save_state(fresh.path, fresh.state)
    fresh.close()
    if change == "seed":
        changed = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=7))
    elif change == "another env":
        changed = load_config(config(tmp_path, {"taskset": "orchestrator-guess-number"}))
    else:
        changed = dataclasses.replace(cfg, env=(dataclasses.replace(cfg.env[0], group_size=4),))
    with pytest.raises(StateError, match="--force") as e:
        OutputDir.open(changed, resume=True)
    assert named in str(e.value)
    forced = OutputDir.open(changed, resume=True, force=True)
    assert forced.state.sampling == sampling_identity(changed)
    forced.close()


def test_identity_changes_lists_each_change() -> None:
    old = {"run.seed": 0, "scheduler.batch_size": 8, "scheduler.token_budget": None,
           "env": [{"name": "a", "group_size": 8, "weight": 1.0}]}
    new = {"run.seed": 0, "scheduler.batch_size": 16, "scheduler.token_budget": None,
           "env": [{"name": "a", "group_size": 8, "weight": 2.0}]}
    assert identity_changes(old, new) == ["scheduler.batch_size: 8 -> 16", "env 'a' weight: 1.0 -> 2.0"]
    assert identity_changes(old, old) == []


def lines_of(path: Path, step: int) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines() if orjson.loads(line).get("step") == step]


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_rows_of_steps_the_trainer_already_had_are_kept_through_a_resume(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    journal = tmp_path / "journal.jsonl"
    async with sim_process() as server:
        cfg, out = write_job(tmp_path, server.url, 4, "held")
        trainer_args = ("receive", f"ipc://{out}/trainer.sock", "--journal", str(journal), "--checkpoint-dir",
                        str(tmp_path / "ckpt"))
        async with orchestrator_process(*trainer_args), orchestrator_process("run", str(cfg)) as run:
            assert await asyncio.wait_for(run.wait(), BOUND_S) == 0
        trained = {s: (lines_of(out / "rollouts.jsonl", s), lines_of(out / "metrics.jsonl", s)) for s in range(4)}
        # the crash window: steps 2 and 3 reached the trainer, the state file did not hear of it
        state = load_state(out, "held")
        state.acked_step = 1
        save_state(out, state)
        cfg.write_text(cfg.read_text().replace("max_steps = 4", "max_steps = 6"))
        async with orchestrator_process(*trainer_args), orchestrator_process("run", str(cfg), "--resume") as run:
            assert await asyncio.wait_for(run.wait(), BOUND_S) == 0
    assert [int(r["step"]) for r in read_journal(journal)] == list(range(6))  # each step trained once
    metrics = [orjson.loads(line) for line in (out / "metrics.jsonl").read_bytes().splitlines()]
    assert [m["step"] for m in metrics] == list(range(6))
    for step in (2, 3):  # regenerated, not sent: the rows are those of the batch the trainer trained
        assert lines_of(out / "rollouts.jsonl", step) == trained[step][0]
        assert lines_of(out / "metrics.jsonl", step) == trained[step][1]
    assert [m["sent"] for m in metrics[4:]] == [True, True]


async def test_two_orchestrators_on_one_output_dir_the_second_exits_1_naming_the_first(tmp_path: Path) -> None:
    cfg = load_config(config(tmp_path))
    holder = OutputDir.open(cfg, resume=False)  # as a running orchestrator holds it
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "run", str(config(tmp_path)), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), BOUND_S)
    finally:
        holder.close()
    assert proc.returncode == 1
    assert f"in use by another orchestrator (pid {os.getpid()}".encode() in stderr
