#!/usr/bin/env bash
# Create .venv at the repo root (Python >= 3.11) and install the project with its dev tools.
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup: need Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    "$PY" -m venv .venv
fi
stamp=.venv/.orchestrator-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "setup: installing the project into .venv (first time: ~2 minutes)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    echo "$want" > "$stamp"
fi
# The offline kit for verifiers' uv harnesses and TextArena (a wheel index, NLTK words) that the end-to-end
# test uses: downloaded here, never by a test. Re-made when the install changed.
kit=.venv/worker-host
if [ ! -f "$kit/env.json" ] || [ "$kit/env.json" -ot "$stamp" ]; then
    echo "setup: preparing the offline worker-host kit in $kit" >&2
    .venv/bin/orchestrator prepare-worker-host "$kit" >&2
fi
