#!/usr/bin/env bash
# DeepSeek-R1-Distill-Qwen-1.5B at lag 4 on 2 nodes x 8 H100 80GB: eight 1-GPU SGLang servers
# on node 1, 8 learner ranks (TP1, DP8) on node 2.
#   slurm/recipes/r1_distill_qwen_1p5b_lag4.sh --run-dir DIR [--dry-run] [options] [key=value ...]
# Options given here can be overridden by repeating them (e.g. --gpu-mem-gb 141 on H200s);
# slurm/launch.sh --help lists them all. The nodes, GPUs and servers are the recipe's cluster:
# section. Settings: examples/r1_distill_qwen_1p5b_lag4.yaml.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../launch.sh" "$here/../../examples/r1_distill_qwen_1p5b_lag4.yaml" \
    --job-name r1_distill_qwen_1p5b_lag4 \
    --model deepseek-r1-distill-qwen-1.5b --gpu-mem-gb 80 --exclusive \
    "$@"
