"""verifiers taskset id ``orchestrator-arithmetic``: the built-in arithmetic environment.

verifiers resolves a taskset id to a top-level module (``orchestrator-arithmetic`` -> this package); the
code lives in ``orchestrator.envs.arithmetic``.
"""

from orchestrator.envs.arithmetic import ArithmeticHarness, ArithmeticTaskset

__all__ = ["ArithmeticHarness", "ArithmeticTaskset"]
