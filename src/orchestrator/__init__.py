"""Rollout orchestrator for LLM reinforcement learning.

The orchestrator drives verifiers environments against vLLM-compatible inference servers and ships each
step's columnar batch to the trainer over ZMQ. See README.md and docs/ for the architecture.
"""

__version__ = "0.1.0"
