#!/usr/bin/env bash
# Install (CPU build of torch, pinned stack) and run lint + the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
python3 -m ruff check .
# Two workers on the 2-core CI machine, whole files per worker (module fixtures are built once); `slow` tests run
# by `python3 -m pytest -m slow` (the MQAR learning check, about 2 minutes); the slowest
# tests are listed at the end. Subprocess time limits only guard against hangs: KDN_TEST_TIMEOUT_FACTOR (default 4)
# scales them all, raise it on a loaded machine.
OMP_NUM_THREADS=1 python3 -m pytest -q -m "not gpu and not slow" -n auto --dist loadfile --durations=25
