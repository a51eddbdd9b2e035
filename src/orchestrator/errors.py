"""The orchestrator's exceptions, in one small tree.

::

    OrchestratorError                 base: anything this package raises on purpose
    ├── ConfigError                   the job's config is wrong (the CLI exits with status 2)
    │   └── KeyFileError              a CURVE key file or directory that is missing, unreadable or the wrong kind
    ├── InferenceError                an inference server failed a request
    │   ├── ServerUnavailable         no server in rotation, or the chosen one is out of rotation
    │   └── MalformedReply            a reply that does not match the protocol
    ├── WireError                     a transport message that cannot be accepted
    │   └── DuplicateStep             a step already received (or out of order)
    ├── TransportError                the transport cannot start or go on as configured
    ├── EnvironmentLoadError          an environment could not be loaded
    └── RolloutError                  a rollout failed; carries the reason recorded for it

Catch only what you can handle: a failed rollout is data (counted and logged once), a ConfigError
stops the process before anything starts, everything else propagates to the TaskGroup that owns the task.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


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
    """An inference server failed a request (HTTP error, timeout, refused connection)."""


class ServerUnavailable(InferenceError):
    """No inference server is in rotation, or the requested one is not."""


class MalformedReply(InferenceError):
    """An inference reply that does not match the protocol (bad JSON, bad token string, NaN logprob...)."""


class WireError(OrchestratorError):
    """A transport message that cannot be accepted: wrong version, missing or short frames, bad header."""


class DuplicateStep(WireError):
    """A step that was already received, or that arrives out of order."""


class TransportError(OrchestratorError):
    """The transport cannot start or go on as configured (e.g. a batch directory holding another run)."""


class EnvironmentLoadError(OrchestratorError):
    """An environment could not be loaded; the message names the environment."""


class RolloutError(OrchestratorError):
    """A rollout failed; ``reason`` is the short machine-readable cause that is counted in metrics."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(f"{reason}: {message}")
