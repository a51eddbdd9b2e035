#!/usr/bin/env bash
# The real stack on this machine (docs/real-stack.md): .venv with the [torch] extra (the PyTorch trainer), then a
# vLLM server venv, the CPU build of torch and the tiny dense and MoE models in .real-stack/. Cached: a second run
# takes seconds. Extra arguments go to `orchestrator real-stack setup` (e.g. --dir DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # cache compiled modules: scripts/setup.sh says why
EXTRAS=dev,torch bash scripts/setup.sh
exec .venv/bin/orchestrator real-stack setup "$@"
