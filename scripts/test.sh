#!/usr/bin/env bash
# Quick start, line 2 (and what CI runs): set up .venv, then lint, type check and the whole test suite, then the
# end-to-end, resume, fault, shutdown, supervision and sinks tests again on the direct data plane (docs/data-plane.md).
# Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "== ruff" >&2
.venv/bin/ruff check src tests scripts
echo "== mypy" >&2
.venv/bin/mypy
echo "== pytest" >&2
.venv/bin/pytest "$@"
# Their jobs run with data_plane = "direct"; tests there that do not depend on it are deselected (they ran above).
# The sender conformance suite is not here: it runs its zmq-direct kind above.
echo "== pytest --data-plane direct" >&2
status=0
.venv/bin/pytest --data-plane direct tests/test_orchestrator.py tests/test_resume.py tests/test_faults.py \
    tests/test_shutdown.py tests/test_supervision.py tests/test_run_command.py tests/test_sinks.py "$@" || status=$?
[ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"  # 5: the extra arguments selected none of them
