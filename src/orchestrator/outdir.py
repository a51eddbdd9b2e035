"""A run's output directory: one orchestrator at a time, a fresh or resumed start, and outputs that match what
the trainer trained.

- **Lock.** ``OutputDir.open`` takes an exclusive ``flock`` on ``.orchestrator.lock`` (holding the owner's pid
  and run) for the process's lifetime; a second orchestrator on the same directory is refused with the first
  one's pid, before it touches anything. The kernel drops the lock when the holder dies, even by SIGKILL, so a
  crash never leaves a stale lock.
- **Fresh start** clears the previous run's ``rollouts.jsonl``, ``metrics.jsonl`` and ``eval_rollouts.jsonl``.
- **Resume** loads the state; steps after the last acknowledged one are generated again, and their old rows
  are taken out of the files and *held*: when the trainer turns out to have had such a step (the sender
  skips it), its held rows (what was trained) are written back instead of the regeneration's; a step sent
  again gets the new rows. A skipped step without held rows gets the regeneration's rows marked
  ``"regenerated": true``.
- **What is sampled** (seed, step size, environments) is recorded in the state; a resume whose config changes
  it is refused, naming each change, unless forced.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from orchestrator.config import JobConfig
from orchestrator.errors import OrchestratorError
from orchestrator.state import OrchestratorState, StateError, load_state
from orchestrator.steps.outputs import drop_steps_from, lines_by_step

LOCK_FILE = ".orchestrator.lock"
OUTPUT_FILES = ("rollouts.jsonl", "metrics.jsonl", "eval_rollouts.jsonl")


class OutputDirInUse(OrchestratorError):
    """Another orchestrator holds the output directory."""


def sampling_identity(cfg: JobConfig) -> dict[str, Any]:
    """What decides what a run samples: a resumed run must keep it to continue the same sequence."""
    return {"run.seed": cfg.run.seed, "scheduler.batch_size": cfg.scheduler.batch_size,
            "scheduler.token_budget": cfg.scheduler.token_budget,
            "env": [{"name": e.label, "taskset": e.taskset, "args": dict(e.args), "group_size": e.group_size,
                     "weight": e.weight} for e in cfg.env]}


def identity_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """Each difference between two ``sampling_identity`` values, as ``key: saved -> now``."""
    changes = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in now if k != "env" and saved.get(k) != now[k]]
    old_envs = {e["name"]: e for e in saved.get("env", [])}
    new_envs = {e["name"]: e for e in now["env"]}
    if list(old_envs) != list(new_envs):
        changes.append(f"env: {list(old_envs)} -> {list(new_envs)}")
    for name in old_envs.keys() & new_envs.keys():
        changes += [f"env {name!r} {k}: {old_envs[name].get(k)!r} -> {v!r}" for k, v in new_envs[name].items()
                    if old_envs[name].get(k) != v]
    return changes


@dataclass
class OutputDir:
    path: Path
    state: OrchestratorState
    held: dict[int, tuple[list[bytes], list[bytes]]] = field(default_factory=dict)  # step -> (rollouts, metrics)
    _lock: IO[str] | None = None

    @classmethod
    def open(cls, cfg: JobConfig, *, resume: bool, force: bool = False) -> OutputDir:
        """Lock the directory and prepare it (blocking). OutputDirInUse, StateError (e.g. no state to resume,
        or a config that changes what is sampled, without ``force``)."""
        path = Path(cfg.run.output_dir).resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OrchestratorError(f"run.output_dir {path}: cannot create it ({e.strerror})") from None
        lock = _lock(path, cfg.run.name)
        try:
            return cls._prepare(cfg, path, lock, resume, force)
        except BaseException:
            lock.close()
            raise

    @classmethod
    def _prepare(cls, cfg: JobConfig, path: Path, lock: IO[str], resume: bool, force: bool) -> OutputDir:
        identity = sampling_identity(cfg)
        if not resume:
            for name in OUTPUT_FILES:
                (path / name).unlink(missing_ok=True)
            return cls(path, OrchestratorState(cfg.run.name, sampling=identity), _lock=lock)
        state = load_state(path, cfg.run.name)
        changes = identity_changes(state.sampling, identity) if state.sampling else []
        if changes and not force:
            raise StateError(f"{path}: --resume with a config that changes what is sampled ({'; '.join(changes)}); "
                             "the resumed run would not continue the same run. Put the config back, use another "
                             "run.output_dir, or pass --force to resume anyway")
        state.sampling = identity
        tails = [drop_steps_from(path / name, state.acked_step + 1) for name in OUTPUT_FILES]
        rollouts, metrics = lines_by_step(tails[0]), lines_by_step(tails[1])
        held = {step: (rollouts.get(step, []), metrics[step]) for step in metrics}  # only whole steps
        return cls(path, state, held, _lock=lock)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def _lock(path: Path, run: str) -> IO[str]:
    f = open(path / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the run: the lock lives with the fd
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "unknown"
        f.close()
        raise OutputDirInUse(f"run.output_dir {path} is in use by another orchestrator ({owner}); stop it, or "
                             "give this run another run.output_dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}, run {run!r}")
    f.flush()
    return f
