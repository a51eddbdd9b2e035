#!/usr/bin/env bash
# Quick start, line 1: set up .venv with what the demo uses (the package and matplotlib for its plots) and run the
# embedded demo (simulated inference, real environments, reference trainer, all on this machine). Extra arguments
# go to `orchestrator demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # cache compiled modules: scripts/setup.sh says why
bash scripts/setup.sh
exec .venv/bin/orchestrator demo "$@"
