"""Talking to vLLM-compatible inference servers: the pool (choice, health, weight sync) and reply parsing."""
