"""The orchestrator's exceptions, in one small tree.

::

    OrchestratorError                 base: anything this package raises on purpose
    ├── ConfigError                   the job's config is wrong (the CLI exits with status 2)
    │   └── KeyFileError              a CURVE key file or directory that is missing, unreadable or the wrong kind
    ├── InferenceError                an inference server failed a request
    │   └── MalformedReply            a reply that does not match the protocol
    ├── WireError                     a transport message that cannot be accepted
    │   └── DuplicateStep             a step already received (or out of order)
    ├── TransportError                the transport cannot start or go on as configured
    │   └── TrainerRefused            the orchestrator refused this trainer (another holds the link, or it lacks
    │                                 steps that are gone), or its CURVE key for good; raised by the trainer
    │                                 library's ``recv`` (and ``ack``, ``announce``)
    ├── CheckpointError               a checkpoint that cannot be loaded (no weights path; none loads for too long)
    │   └── UnloadableCheckpoint      its directory is missing, holds no weight files or a corrupt one
    ├── TransferError                 weights over the wire cannot go on (the trainer died during a broadcast)
    ├── EnvironmentLoadError          an environment could not be loaded
    └── WorkerError                   env workers cannot serve the job (none became ready in time)

Catch only what you can handle: a failed rollout is data (a ``Failure`` kind, below, counted and logged once,
never an exception), a ConfigError stops the process before anything starts, everything else propagates to
the TaskGroup that owns the task.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from pathlib import Path


class Failure(enum.StrEnum):
    """Why a rollout failed: the reason counted in metrics (``failed:<kind>``) and written in each row."""

    PROVIDER = "provider_error"  # the inference server refused or failed a request (HTTP error, connection)
    TIMEOUT = "timeout"  # a request to the inference server, or the rollout's own deadline, timed out
    MALFORMED = "malformed_reply"  # the inference server answered something that does not parse
    ENV = "env_error"  # the environment (its harness, setup or task code) raised
    SCORING = "scoring_error"  # the environment's reward or metric functions raised
    INVALID_REWARD = "invalid_reward"  # a reward that is not a finite number
    BAD_SAMPLE = "inconsistent_sample"  # trace data that cannot make a training sample
    CORRUPT = "corrupt_record"  # a record whose frames do not match its header
    POOL_TOO_SMALL = "pool_too_small"  # its columns exceed the env worker's whole column pool (the direct data plane)
    WORKER_DIED = "worker_died"  # the env worker running it died, froze or was dropped
    STALE = "stale"  # cancelled: sampled too many policy versions ago
    GROUP_TIMEOUT = "group_timeout"  # its group ran longer than scheduler.group_timeout_s
    KV_PRESSURE = "kv_pressure"  # cancelled: its server's KV cache was nearly full (scheduler.concurrency)
    # the teacher ([teacher]) could not score its samples, after its retries (workers/teacher.py)
    TEACHER_ERROR = "teacher_error"  # the teacher refused or failed (HTTP error, connection refused, down)
    TEACHER_TIMEOUT = "teacher_timeout"  # no answer within teacher.request_timeout_s
    TEACHER_MALFORMED = "teacher_malformed"  # an answer without a finite logprob for every token

    @property
    def server_fault(self) -> bool:
        """Whether the inference server is to blame (it counts against that server's health)."""
        return self in (Failure.PROVIDER, Failure.TIMEOUT, Failure.MALFORMED)


class OrchestratorError(Exception):
    """Base class of every exception this package raises on purpose."""


class ConfigError(OrchestratorError):
    """One or more problems in a config file; each names the file and the full key path."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class KeyFileError(ConfigError):
    """A CURVE key file (or authorized-keys directory) that is missing, unreadable or of the wrong kind; the
    message names the path and what was expected there."""

    def __init__(self, path: str | Path, why: str) -> None:
        self.path = Path(path)
        super().__init__([f"{path}: {why}"])


class InferenceError(OrchestratorError):
    """An inference server failed a request (HTTP error, timeout, refused connection); ``kind`` says which."""

    def __init__(self, message: str, kind: Failure | None = None) -> None:
        super().__init__(message)
        self.kind = Failure.PROVIDER if kind is None else kind


class MalformedReply(InferenceError):
    """An inference reply that does not match the protocol (bad JSON, bad token string, NaN logprob...)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, Failure.MALFORMED)


class WireError(OrchestratorError):
    """A transport message that cannot be accepted: wrong version, missing or short frames, bad header."""


class DuplicateStep(WireError):
    """A step that was already received, or that arrives out of order."""


class TransportError(OrchestratorError):
    """The transport cannot start or go on as configured (e.g. a batch directory holding another run)."""


class TrainerRefused(TransportError):
    """The orchestrator will not feed this trainer; the message says why and what to do."""


class CheckpointError(OrchestratorError):
    """A checkpoint the trainer announced that cannot be loaded (e.g. no path for its weights)."""


class UnloadableCheckpoint(CheckpointError):
    """A checkpoint whose directory no server could load (``why``: "does not exist", "holds a corrupt file ...");
    it is refused before any server is asked to load it (inference/checkpoint_files.py)."""

    def __init__(self, step: int, path: str, why: str) -> None:
        self.step = step
        self.path = path
        self.why = why
        super().__init__(f"checkpoint {step} cannot be loaded: {path} {why}")


class TransferError(OrchestratorError):
    """Weights over the wire cannot go on: the message names the step, the trainer and what failed."""


class EnvironmentLoadError(OrchestratorError):
    """An environment could not be loaded; the message names the environment."""


class WorkerError(OrchestratorError):
    """Env workers cannot serve the job (e.g. none became ready in time); the message says what is missing."""
