#!/usr/bin/env bash
# Qwen2.5-Math-1.5B on 2 nodes x 8 H100 80GB: eight 1-GPU SGLang servers on node 1,
# 8 learner ranks (TP1, DP8) on node 2.
#   slurm/recipes/qwen2p5_math_1p5b.sh --run-dir DIR [--dry-run] [options] [key=value ...]
# Options given here can be overridden by repeating them (e.g. --gpu-mem-gb 141 on H200s);
# slurm/launch.sh --help lists them all. The nodes, GPUs and servers are the recipe's cluster:
# section. Settings: examples/qwen2p5_math_1p5b.yaml.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../launch.sh" "$here/../../examples/qwen2p5_math_1p5b.yaml" \
    --job-name qwen2p5_math_1p5b \
    --model qwen2.5-math-1.5b --gpu-mem-gb 80 --exclusive \
    "$@"
