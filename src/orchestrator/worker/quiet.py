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
  nothing is lost; a rollout whose live requests were refused fails with its reason in rollouts.jsonl. That one
  message goes to DEBUG (``--log-level DEBUG`` shows it); every other warning of verifiers is kept.

``quiet_libraries()`` runs once at the start of ``orchestrator env-worker``, before verifiers is imported.
"""

from __future__ import annotations

import logging
import os

ENV = {"TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
INTERCEPTION_LOGGER = "verifiers.v1.interception.server"
ENDED_ROLLOUT_REQUEST = "interception: unauthorized request"


class EndedRolloutRequests(logging.Filter):
    """verifiers' "unauthorized request" warning, as DEBUG (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or record.getMessage() != ENDED_ROLLOUT_REQUEST:
            return True
        record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_libraries() -> None:
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    logger = logging.getLogger(INTERCEPTION_LOGGER)
    if not any(isinstance(f, EndedRolloutRequests) for f in logger.filters):
        logger.addFilter(EndedRolloutRequests())
