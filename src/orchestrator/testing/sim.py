"""Simulated inference servers for tests (re-exported from orchestrator.sim.process)."""

from orchestrator.sim.process import SimProcess, sim_process, sim_servers

__all__ = ["SimProcess", "sim_process", "sim_servers"]
