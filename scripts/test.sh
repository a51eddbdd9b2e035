#!/usr/bin/env bash
# Quick start, line 2 (and what CI runs): set up .venv, then lint, type check and the whole test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff" >&2
.venv/bin/ruff check src tests scripts
echo "== mypy" >&2
.venv/bin/mypy
echo "== pytest" >&2
.venv/bin/pytest "$@"
