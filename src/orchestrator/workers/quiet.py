"""Library messages an env worker prints that say nothing to a person, each silenced at its cause.

- transformers warns "PyTorch was not found" when it is imported (verifiers' renderer loads tokenizers
  through it). An env worker only tokenizes: it never needs torch. ``TRANSFORMERS_NO_ADVISORY_WARNINGS`` is
  transformers' own switch for such advice (``transformers.utils.logging.warning_advice``); a value the user
  set wins.
- verifiers' interception server warns "interception: unauthorized request" when a request arrives for a
  rollout that has already ended. In an env worker the only clients holding a rollout's secret are that
  rollout's own programs, so the request is a straggler of a rollout the worker cancelled (a stale group, a
  stop): its harness had sent the next model call just before, and on uvloop the server reads it after
  verifiers closed the session (16 cancelled rollouts at random points: a warning in 47 of 150 rounds;
  verifiers' own docs call these "a request whose program died at teardown"). verifiers answers it 401 and
  nothing is lost; a rollout whose live requests were refused fails with its reason in rollouts.jsonl. That
  message goes to DEBUG (``--log-level DEBUG`` shows it).
- verifiers' interception server warns "model call failed: id=... <error>" for every model call that fails. A
  call that fails fails its rollout, which the orchestrator logs with its reason (one line per server event:
  the first failure in a row, then the server's eviction) and writes to rollouts.jsonl; a server that dies
  holding 27 rollouts printed 27 of these on the run's log. That message goes to DEBUG too.

Every other warning of verifiers is kept.

``quiet_libraries()`` runs once at the start of ``orchestrator env-worker``, before verifiers is imported.
"""

from __future__ import annotations

import logging
import os

ENV = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
INTERCEPTION_LOGGER = "verifiers.v1.interception.server"
ENDED_ROLLOUT_REQUEST = "interception: unauthorized request"
FAILED_MODEL_CALL = "model call failed: id=%s %s: %s"  # the format string: its arguments vary
DEMOTED = frozenset({ENDED_ROLLOUT_REQUEST, FAILED_MODEL_CALL})


class DemotedWarnings(logging.Filter):
    """verifiers' "unauthorized request" and "model call failed" warnings, as DEBUG (the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.msg not in DEMOTED:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_libraries() -> None:
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    logger = logging.getLogger(INTERCEPTION_LOGGER)
    if not any(isinstance(f, DemotedWarnings) for f in logger.filters):
        logger.addFilter(DemotedWarnings())
