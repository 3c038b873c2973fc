#!/usr/bin/env bash
# Qwen2.5-7B-Instruct with a Python tool on 2 nodes x 8 H100 80GB: eight 1-GPU SGLang servers
# on node 1, 8 learner ranks (TP4 + SP, DP2) on node 2.
#   slurm/recipes/qwen2p5_7b_python_tool.sh --run-dir DIR [--dry-run] [options] [key=value ...]
# Options given here can be overridden by repeating them (e.g. --gpu-mem-gb 141 on H200s);
# slurm/launch.sh --help lists them all. The nodes, GPUs and servers are the recipe's cluster:
# section. Settings: examples/qwen2p5_7b_python_tool.yaml.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../launch.sh" "$here/../../examples/qwen2p5_7b_python_tool.yaml" \
    --job-name qwen2p5_7b_python_tool \
    --model qwen2.5-7b-instruct --gpu-mem-gb 80 --exclusive \
    "$@"
