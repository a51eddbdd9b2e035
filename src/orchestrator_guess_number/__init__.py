"""verifiers taskset id ``orchestrator-guess-number``: the built-in multi-turn environment.

verifiers resolves a taskset id to a top-level module; the code lives in ``orchestrator.envs.guess_number``.
"""

from orchestrator.envs.guess_number import GuessNumberHarness, GuessNumberTaskset

__all__ = ["GuessNumberHarness", "GuessNumberTaskset"]
