#!/usr/bin/env bash
# Quick start, line 2 (and what CI runs): set up .venv (with the [torch] extra: the PyTorch trainer's tests), then
# lint, type check and the whole test suite, then the end-to-end, resume, fault, shutdown, supervision, sinks and
# distillation tests again on the direct data plane (docs/data-plane.md), then the real stack (docs/real-stack.md):
# real vLLM servers for CPUs (0.32.0, and 0.31.0 for one job) and tiny real models set up in .real-stack (cached), and
# the tests against them (tests/real).
# Extra arguments go to every pytest run. REAL_STACK=0 skips the real stack (say so when you report a run).
# SLURM and munge are installed first (scripts/slurm-setup.sh) for tests/test_launch_slurm.py (marked slurm).
#
# Each stage prints its wall time as it ends, and each pytest stage its 20 slowest tests; a table of every
# stage's wall time closes the run, whether it passed or not. A new stage is one `stage NAME COMMAND...` line
# (`tests NAME PYTEST-ARGS...` for pytest). The suite runs in PYTEST_WORKERS processes (pytest-xdist; default 2,
# 0 runs it in this one): its tests mostly wait on the processes they start. The real stack's tests share their
# servers within one session, so they run in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # cache compiled modules: scripts/setup.sh says why

SUMMARY=()  # one line per stage run: name, wall time, exit status
START=$SECONDS

stage() {  # stage NAME COMMAND...: run COMMAND as stage NAME, timed; its exit status is the stage's
    local name=$1 start=$SECONDS status=0
    shift
    echo "== $name" >&2
    "$@" || status=$?
    local took=$((SECONDS - start))
    echo "== $name: ${took} s (exit $status)" >&2
    SUMMARY+=("$(printf '%-34s %6d s   exit %d' "$name" "$took" "$status")")
    return "$status"
}

tests() {  # tests NAME PYTEST-ARGS...: a pytest stage that lists its 20 slowest tests; none selected (exit 5:
    # the extra arguments selected none of its tests) passes
    local name=$1 status=0
    shift
    stage "$name" .venv/bin/pytest --durations=20 "$@" || status=$?
    [ "$status" -eq 0 ] || [ "$status" -eq 5 ] || return "$status"
}

MYPY_PID=  # mypy, run beside the main suite
REAL_SETUP_PID=  # the real stack's setup, run in the background while the suites run
REAL_SETUP_LOG=.real-stack/setup.log

summary() {
    local status=$?
    if [ -n "$REAL_SETUP_PID" ]; then kill -- "-$REAL_SETUP_PID" 2>/dev/null || true; fi  # its own process group
    if [ -n "$MYPY_PID" ]; then pkill -P "$MYPY_PID" 2>/dev/null || true; kill "$MYPY_PID" 2>/dev/null || true; fi
    rm -f "${MYPY_LOG:-}"
    {
        echo "== stages (wall time)"
        printf '%s\n' "${SUMMARY[@]}"
        printf '%-34s %6d s\n' "total" $((SECONDS - START))
    } >&2
    return "$status"
}
trap summary EXIT

stage "setup (.venv)" env EXTRAS=dev,torch bash scripts/setup.sh
if [ "${REAL_STACK:-1}" != 0 ]; then
    # the real stack's setup is mostly downloads and unpacking (vLLM venvs: minutes on a fresh machine), so it runs
    # in its own process group (set -m), niced, while lint, type check and the suites run; its stage below waits for
    # it and prints its log. Not a session of its own (setsid): where the kernel groups CPU time by session
    # (sched_autogroup), that took half the machine from the suites whatever their needs
    mkdir -p .real-stack
    set -m
    nice -n 5 .venv/bin/orchestrator real-stack setup --dir .real-stack --vllm 0.32.0 --vllm 0.31.0 \
        >"$REAL_SETUP_LOG" 2>&1 &
    REAL_SETUP_PID=$!
    set +m
fi
real_setup() {  # wait for the background setup; its log either way
    local status=0
    wait "$REAL_SETUP_PID" || status=$?
    REAL_SETUP_PID=
    cat "$REAL_SETUP_LOG" >&2
    return "$status"
}
stage "ruff" .venv/bin/ruff check src tests scripts
# mypy (~85 s of one core) runs beside the main suite, niced, on the part of the 2 cores its processes leave idle
# (~0.4 on average: they mostly wait on each other); its stage below waits for it and prints its output
MYPY_LOG=$(mktemp)
(
    start=$SECONDS status=0
    nice -n 19 .venv/bin/mypy || status=$?
    echo "mypy: $((SECONDS - start)) s beside the main suite"
    exit "$status"
) >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
mypy_result() {
    local status=0
    wait "$MYPY_PID" || status=$?
    MYPY_PID=
    cat "$MYPY_LOG" >&2
    rm -f "$MYPY_LOG"
    return "$status"
}
# the SLURM cluster of tests/test_launch_slurm.py (Debian packages; ~15 s the first time, then ~0.1 s)
stage "SLURM setup" bash scripts/slurm-setup.sh
# by file: a module's shared fixture (test_learning's runs, test_bad_envs' job) runs once. Not loadgroup: on pytest
# 9.2 it silently stops grouping (pytest-xdist issue #1386)
WORKERS=(-n "${PYTEST_WORKERS:-2}" --dist loadfile)
main_status=0
stage "pytest" .venv/bin/pytest --durations=20 "${WORKERS[@]}" "$@" || main_status=$?  # strict: none run fails
stage "mypy (ran beside pytest)" mypy_result
[ "$main_status" -eq 0 ] || exit "$main_status"
# Their jobs run with data_plane = "direct"; tests there that do not depend on it are deselected (they ran above).
# The sender conformance suite is not here: it runs its zmq-direct kind above.
tests "pytest --data-plane direct" "${WORKERS[@]}" --data-plane direct tests/test_orchestrator.py tests/test_resume.py \
    tests/test_faults.py tests/test_shutdown.py tests/test_supervision.py tests/test_run_command.py \
    tests/test_sinks.py tests/test_distill.py "$@"
if [ "${REAL_STACK:-1}" = 0 ]; then
    echo "== real stack: skipped (REAL_STACK=0)" >&2
    exit 0
fi
stage "real stack: setup (waited for)" real_setup
tests "pytest --real-stack tests/real" --real-stack .real-stack tests/real "$@"
