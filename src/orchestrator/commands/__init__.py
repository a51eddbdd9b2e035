"""Subcommands of the ``orchestrator`` CLI, one module each (see orchestrator.cli)."""
