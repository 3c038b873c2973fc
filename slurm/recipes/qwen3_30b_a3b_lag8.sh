#!/usr/bin/env bash
# Qwen3-30B-A3B at lag 8 on 4 nodes x 8 H100 80GB: four SGLang servers (TP4) on nodes 1-2,
# 16 learner ranks (TP4 + SP, CP2, EP8, ETP1) on nodes 3-4, 9,216 tokens per micro-batch and
# GPU, selective recompute (set in the recipe): its 18,432-token rows fit the micro-batches
# (tools/plan_layout.py --recipe examples/qwen3_30b_a3b_lag8.yaml --gpu-mem-gb 80: peak
# 53.74 GiB with the stated untraced terms + 4 GiB reserve).
#   slurm/recipes/qwen3_30b_a3b_lag8.sh --run-dir DIR [--dry-run] [options] [key=value ...]
# Options given here can be overridden by repeating them (e.g. --gpu-mem-gb 141 on H200s);
# slurm/launch.sh --help lists them all. The nodes, GPUs and servers are the recipe's cluster:
# section. Settings: examples/qwen3_30b_a3b_lag8.yaml.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../launch.sh" "$here/../../examples/qwen3_30b_a3b_lag8.yaml" \
    --job-name qwen3_30b_a3b_lag8 \
    --model qwen3-30b-a3b --gpu-mem-gb 80 --exclusive \
    "$@"
