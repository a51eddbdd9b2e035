#!/usr/bin/env bash
# Create .venv at the repo root (Python >= 3.11) and install the project with its dev tools (EXTRAS: the extras
# to install, default "dev"; scripts/real-stack.sh asks for "dev,torch").
# Re-running is cheap: the install is skipped while pyproject.toml is unchanged and the extras are installed.
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
extras="${EXTRAS:-dev}"
stamp=.venv/.orchestrator-installed
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
read -r have_hash have_extras < "$stamp" 2>/dev/null || true
missing=0
for e in ${extras//,/ }; do [[ ",${have_extras:-}," == *",$e,"* ]] || missing=1; done
if [ "${have_hash:-}" != "$hash" ] || [ "$missing" = 1 ]; then
    [ "${have_hash:-}" = "$hash" ] && extras="$have_extras,$extras"  # keep what is installed
    echo "setup: installing the project into .venv with [$extras] (first time: ~2 minutes)" >&2
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[dev]"
    if [[ ",$extras," == *",torch,"* ]]; then  # torch's CPU build first: pip would satisfy torch>=2.4 with CUDA's
        .venv/bin/python -c 'from orchestrator.realstack.install import ensure_torch; ensure_torch(print)'
    fi
    .venv/bin/python -m pip install --quiet -e ".[$extras]"
    echo "$hash $extras" > "$stamp"
fi
# The offline kit for verifiers' uv harnesses and TextArena (a wheel index, NLTK words) that the end-to-end
# test uses: downloaded here, never by a test. Re-made when the install changed.
kit=.venv/worker-host
if [ ! -f "$kit/env.json" ] || [ "$kit/env.json" -ot "$stamp" ]; then
    echo "setup: preparing the offline worker-host kit in $kit" >&2
    .venv/bin/orchestrator prepare-worker-host "$kit" >&2
fi
