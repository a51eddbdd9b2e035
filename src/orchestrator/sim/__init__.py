"""The built-in simulated vLLM-compatible inference server (demo, tests, benchmarks)."""
