"""The built-in simulated inference server (demo, tests, benchmarks): it plays vLLM 0.26 / 0.32 / 0.33 or
prime-rl's server, each as read from its source (``profiles.py``)."""
