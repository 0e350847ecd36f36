#!/usr/bin/env bash
# Install (CPU build of torch, pinned stack) and run lint + the CPU test suite; at the end it prints its wall time
# and the 15 slowest tests (docs/testing.md says what each of them checks and why it costs what it does).
set -euo pipefail
start=$SECONDS
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
python3 -m ruff check .
# Two workers on the 2-core CI machine, whole files per worker (module fixtures are built once), the longest files
# first (tests/conftest.py: LONGEST_FIRST; --no-loadscope-reorder keeps that order); `slow` tests run
# by `python3 -m pytest -m slow` (the MQAR learning check, about 2 minutes). Subprocess time limits only guard
# against hangs: KDN_TEST_TIMEOUT_FACTOR (default 4) scales them all, raise it on a loaded machine.
pytest_start=$SECONDS
rc=0
OMP_NUM_THREADS=1 python3 -m pytest -q -m "not gpu and not slow" -n 2 --dist loadfile --no-loadscope-reorder --durations=15 || rc=$?
echo "scripts/test.sh: $((SECONDS - start)) s end to end, pytest $((SECONDS - pytest_start)) s (exit $rc)"
exit "$rc"
