#!/usr/bin/env bash
# The whole test suite on a CPU machine: set up .venv (idempotent), lint, then every test.
#   bash tools/run_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_cpu.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest's exit code 5 ("no tests collected") fails this script like any other failure.
.venv/bin/python -m pytest "$@"
