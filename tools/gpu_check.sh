#!/usr/bin/env bash
# The GPU path end to end, in three tiers, printing figures (the steps: tools/gpu_check.py).
#   tools/gpu_check.sh [--out DIR] [--dry-run] [--require-all]
# single (one H100/H200; torch, transformers and megatron-core from wheels, no network; meant
# to take under 8 min, not yet timed with these steps): the tiny Qwen3-MoE learner on CUDA in
# bf16 against transformers with every layer spec the machine has (packed rows too);
# tools/bench_learner.py's torch and local specs on a 4-layer Qwen3-30B-A3B slice at 4,096
# tokens (their model TFLOP/s and ratio), the torch spec on the 8-layer slice at 16,384
# packed tokens; tools/bench_attention.py (the torch spec's CP attention at the flagship's CP2
# shape); 3 steps of the training loop with a disk weight update.
# cluster (SGLang and >= 2 GPUs; no transformer-engine needed): a real SGLang server
# (--skip-tokenizer-init) updated over NCCL from the learner, its log-probs against the
# learner's, GB/s per bucket, both bucket formats.
# te (transformer-engine, built from source, not in requirements.txt, and a GPU): the parity
# check with TE's layer spec.
# A tier that cannot run here prints "SKIPPED: <tier> tier: <why>" and counts as neither
# passed nor failed; the last line names every tier's outcome. --dry-run prints the plan and
# checks that the Python parts import (no GPU).
# Exit status: 1 when a step or probe failed; with --require-all, 4 when a tier was skipped;
# else 0. The interpreter: $MFR_PYTHON, else the repository's .venv, else python3 on PATH.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${MFR_PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
out=${TMPDIR:-/tmp}/megatron-fr-gpu-check
dry_run=0
require_all=0
while [ $# -gt 0 ]; do
    case $1 in
        --out) out=$2; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --require-all) require_all=1; shift ;;
        -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
check() { "$python" "$repo/tools/gpu_check.py" "$@"; }
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
# As the Slurm jobs set it: NCCL's cuMem buffers are not shareable between the learner and the
# SGLang processes of the weight-update group.
export NCCL_CUMEM_ENABLE=0

if [ "$dry_run" = 1 ]; then
    check plan
    exit 0
fi

mkdir -p "$out"
failed=()
outcomes=()
skipped=0
# One step: its own time limit, its figures on stdout, a failure recorded (not fatal).
step() {
    local name=$1 limit=$2 started=$SECONDS rc=0
    shift 2
    echo "--- $name"
    timeout "$limit" "$python" "$repo/tools/gpu_check.py" "$name" --out "$out" "$@" || rc=$?
    echo "    ($name: $((SECONDS - started)) s, exit $rc)"
    if [ "$rc" -ne 0 ]; then failed+=("$name"); fi
}

# A tier: its probe (exit 4: skipped, the reason on its "skipped:" line), then its steps.
run_tier() {
    local tier=$1 rc=0 probed reason before=${#failed[@]}
    shift
    echo "=== $tier tier"
    probed=$(check probe "$tier") || rc=$?
    echo "$probed"
    if [ "$rc" -eq 4 ]; then
        reason=$(printf '%s\n' "$probed" | sed -n 's/^skipped: //p' | tail -n 1)
        echo "SKIPPED: $tier tier: ${reason:-the probe gave no reason}"
        outcomes+=("$tier SKIPPED (${reason:-no reason given})")
        skipped=$((skipped + 1))
        return 0
    elif [ "$rc" -ne 0 ]; then
        failed+=("probe $tier")
        outcomes+=("$tier FAILED (probe exit $rc)")
        return 0
    fi
    "$@"
    if [ "${#failed[@]}" -gt "$before" ]; then
        outcomes+=("$tier FAILED")
    else
        outcomes+=("$tier passed")
    fi
}

single_tier() {
    step parity 120
    step bench 300
    step train 240
}

cluster_tier() {
    step sglang 480
}

te_tier() {
    step parity 180
}

run_tier single single_tier
run_tier cluster cluster_tier
run_tier te te_tier
summary=$(printf '%s; ' "${outcomes[@]}")
echo "gpu_check: ${summary%; } (work dir $out)"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
if [ "$skipped" -gt 0 ]; then
    if [ "$require_all" = 1 ]; then
        echo "gpu_check: NOT COMPLETE: $skipped tier(s) skipped and --require-all was given"
        exit 4
    fi
    echo "gpu_check: $skipped tier(s) SKIPPED: they proved nothing on this machine"
fi
