"""verifiers taskset id ``orchestrator-faulty``: an environment that fails on purpose, for tests.

verifiers resolves a taskset id to a top-level module (``orchestrator-faulty`` -> this package); the code
lives in ``orchestrator.testing.faulty_env``, which documents the faults its args select.
"""

from orchestrator.testing.faulty_env import FaultyHarness, FaultyTaskset

__all__ = ["FaultyHarness", "FaultyTaskset"]
