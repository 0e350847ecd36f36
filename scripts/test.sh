#!/usr/bin/env bash
# Install (CPU build of torch, pinned stack) and run lint + the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
python3 -m ruff check .
python3 -m pytest -q -m "not gpu"
