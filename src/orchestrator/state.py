"""Orchestrator state, saved atomically so a killed run resumes at the next step.

The state is a small msgpack map: format version, run name, the last step handed to the transport, the
last step the trainer acknowledged, the policy step being sampled (and its weights' path), and the
scheduler's state: everything that decides what is sampled next (the env-mixing generator, each env's task
cursor or curriculum statistics, the number of draws) and the evaluation schedule. Buffered (finished but
untrained) rollouts and groups in flight are deliberately not saved: they die with the run, and the
resumed sampler goes on with the draws an uninterrupted run would have made after them. That costs a little
inference and keeps the file small and the off-policy accounting exact.

``save_state`` writes a temp file in the same directory, fsyncs it and renames it over the old one, so a
crash at any point leaves either the old state or the new one, never a torn file.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from orchestrator.errors import OrchestratorError

STATE_VERSION = 2  # 2: the scheduler's state replaces task cursors
STATE_FILE = "orchestrator-state.msgpack"


class StateError(OrchestratorError):
    """A state file that cannot be used to resume (missing, corrupt, or from another run or version)."""


@dataclass
class OrchestratorState:
    run: str
    next_step: int = 0  # the first step not yet handed to the transport
    acked_step: int = -1  # the last step the trainer acknowledged
    policy_step: int = 0  # the weight version servers sample with
    policy_path: str | None = None  # where its weights are, as announced (None: inference.weights_path)
    disk_step: int = 0  # the newest synced checkpoint announced with a path (weights over the wire: most are not)
    disk_path: str | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)  # what decides what is sampled next (Scheduler.state)
    sampling: dict[str, Any] = field(default_factory=dict)  # the config's seed, step size, envs (outdir.py)


def save_state(directory: Path, state: OrchestratorState) -> Path:
    """Atomically write ``state`` to ``directory/STATE_FILE`` (blocking; call off the event loop)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / STATE_FILE
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    data = msgpack.packb(
        _pack_ints({"version": STATE_VERSION, **asdict(state)}), use_bin_type=True, default=_unsupported
    )
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException as e:  # a full or read-only disk: no temp file left behind; the old state stays
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise StateError(f"{path}: cannot save the run's state ({e.strerror}); the previous state stays. Free "
                             "space or fix the directory's permissions, then continue with --resume") from None
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


_BIG_INT = 1  # msgpack ext code: an integer past 64 bits (numpy's PCG64 state), as decimal text


def _unsupported(obj: Any) -> Any:
    raise TypeError(f"cannot save {type(obj).__name__} in the orchestrator state")


def _pack_ints(obj: Any) -> Any:
    if isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
        return msgpack.ExtType(_BIG_INT, str(obj).encode())
    if isinstance(obj, dict):
        return {k: _pack_ints(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_pack_ints(v) for v in obj]
    return obj


def _big_int_back(code: int, data: bytes) -> Any:
    if code != _BIG_INT:
        raise ValueError(f"unknown msgpack extension type {code}")
    return int(data.decode())


def load_state(directory: Path, run: str) -> OrchestratorState:
    """Read the state saved by ``save_state``; StateError names the file and what is wrong with it."""
    path = directory / STATE_FILE
    try:
        raw = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False, ext_hook=_big_int_back)
    except FileNotFoundError:
        raise StateError(f"{path}: no saved state to resume from (run without --resume to start fresh)") from None
    except (ValueError, msgpack.UnpackException) as e:
        raise StateError(f"{path}: corrupt state file: {e}") from None
    if not isinstance(raw, dict) or raw.get("version") != STATE_VERSION:
        version = raw.get("version") if isinstance(raw, dict) else None
        raise StateError(f"{path}: state format version {version!r}, this build reads {STATE_VERSION}")
    raw.pop("version")
    if raw.get("run") != run:
        raise StateError(f"{path}: saved by run {raw.get('run')!r}, not {run!r}; use another output_dir")
    try:
        state = OrchestratorState(**raw)
    except TypeError as e:
        raise StateError(f"{path}: unexpected fields in state: {e}") from None
    for name, kind in _FIELD_TYPES.items():  # a hand-edited file: wrong types fail here, by name, not later
        value = getattr(state, name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise StateError(f"{path}: {name} = {value!r} is not {_TYPE_NAMES[name]}; fix the file or start fresh "
                             "(without --resume)")
    return state


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "run": str, "next_step": int, "acked_step": int, "policy_step": int, "policy_path": (str, type(None)),
    "disk_step": int, "disk_path": (str, type(None)), "scheduler": dict, "sampling": dict}
_TYPE_NAMES = {"run": "a string", "policy_path": "a string or nil", "scheduler": "a map", "sampling": "a map",
               "next_step": "an integer", "acked_step": "an integer", "policy_step": "an integer",
               "disk_step": "an integer", "disk_path": "a string or nil"}
