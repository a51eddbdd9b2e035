#!/usr/bin/env bash
# Create .venv at the repo root (Python >= 3.11) and install the project with the extras the caller needs
# (EXTRAS, comma-separated; default "plots", what the demo uses; scripts/test.sh asks for "dev,torch").
# Installs go through uv (installed into .venv first: ~8x faster than pip for verifiers' ~110 packages); torch's CPU
# build comes through pip (the [torch] extra), which knows where this machine keeps it. Re-running is cheap: nothing
# is installed while pyproject.toml is unchanged and the extras are there. With dev, also the offline kit for
# verifiers' uv harnesses that the end-to-end tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python caches compiled modules (__pycache__) in .venv, src and .real-stack: a machine that sets
# PYTHONDONTWRITEBYTECODE (some images do) makes every process compile what it imports again (an env worker's
# imports: 15-17 s of CPU instead of 7; a test file of whole jobs: 131 s instead of 70, docs/development.md)
unset PYTHONDONTWRITEBYTECODE
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "setup: need Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
    exit 1
fi
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv" >&2
    "$PY" -m venv .venv
fi
extras="${EXTRAS:-plots}"
stamp=.venv/.orchestrator-installed
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
have_hash="" have_extras=""
[ -f "$stamp" ] && read -r have_hash have_extras < "$stamp"
missing=0
for e in ${extras//,/ }; do [[ ",$have_extras," == *",$e,"* ]] || missing=1; done
if [ "$have_hash" != "$hash" ] || [ "$missing" = 1 ]; then
    [ "$have_hash" = "$hash" ] && [ -n "$have_extras" ] && extras="$have_extras,$extras"  # keep what is installed
    echo "setup: installing the project into .venv with [$extras]" >&2
    # -qq: pip's own warnings about this machine's package indexes are not ours to show
    [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -qq --disable-pip-version-check "uv>=0.8"
    if [[ ",$extras," == *",torch,"* ]]; then  # torch's CPU build first: uv and pip would take CUDA's for torch>=2.4
        .venv/bin/uv pip install -q --python .venv/bin/python -e .
        .venv/bin/python -c 'from orchestrator.realstack.install import ensure_torch; ensure_torch(print)'
    fi
    .venv/bin/uv pip install -q --python .venv/bin/python -e ".[$extras]"
    echo "$hash $extras" > "$stamp"
fi
# The offline kit for verifiers' uv harnesses and TextArena (a wheel index, NLTK words) that the end-to-end
# tests use: downloaded here, never by a test. Re-made when the install changed.
kit=.venv/worker-host
if [[ ",$extras,$have_extras," == *",dev,"* ]] && { [ ! -f "$kit/env.json" ] || [ "$kit/env.json" -ot "$stamp" ]; }; then
    echo "setup: preparing the offline worker-host kit in $kit" >&2
    .venv/bin/orchestrator prepare-worker-host "$kit" >&2
fi
