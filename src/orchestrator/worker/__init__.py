"""Env workers: processes hosting verifiers environments, and the orchestrator side that drives them."""
