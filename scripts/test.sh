#!/usr/bin/env bash
# Quick start, line 2 (and what CI runs): set up .venv (with the [torch] extra: the PyTorch trainer's tests), then
# lint, type check and the whole test suite, then the end-to-end, resume, fault, shutdown, supervision and sinks
# tests again on the direct data plane (docs/data-plane.md), then the real stack (docs/real-stack.md): a real vLLM
# server for CPUs and tiny real models set up in .real-stack (cached), and the tests against them (tests/real).
# Extra arguments go to every pytest run. REAL_STACK=0 skips the real stack (say so when you report a run).
# SLURM and munge are installed first (scripts/slurm-setup.sh) for tests/test_launch_slurm.py (marked slurm).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,torch bash scripts/setup.sh
echo "== ruff" >&2
.venv/bin/ruff check src tests scripts
echo "== mypy" >&2
.venv/bin/mypy
# the SLURM cluster of tests/test_launch_slurm.py (Debian packages; ~15 s the first time, then ~0.1 s)
bash scripts/slurm-setup.sh
echo "== pytest" >&2
.venv/bin/pytest "$@"
# Their jobs run with data_plane = "direct"; tests there that do not depend on it are deselected (they ran above).
# The sender conformance suite is not here: it runs its zmq-direct kind above.
echo "== pytest --data-plane direct" >&2
status=0
.venv/bin/pytest --data-plane direct tests/test_orchestrator.py tests/test_resume.py tests/test_faults.py \
    tests/test_shutdown.py tests/test_supervision.py tests/test_run_command.py tests/test_sinks.py "$@" || status=$?
[ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"  # 5: the extra arguments selected none of them
if [ "${REAL_STACK:-1}" = 0 ]; then
    echo "== real stack: skipped (REAL_STACK=0)" >&2
    exit 0
fi
echo "== real stack: setup (.real-stack; cached)" >&2
start=$SECONDS
.venv/bin/orchestrator real-stack setup --dir .real-stack
echo "== pytest --real-stack .real-stack tests/real" >&2
status=0
.venv/bin/pytest --real-stack .real-stack tests/real "$@" || status=$?
echo "== real stack: $((SECONDS - start)) s, setup included" >&2
[ "$status" -eq 0 ] || [ "$status" -eq 5 ] || exit "$status"
