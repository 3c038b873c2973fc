#!/usr/bin/env bash
# CPU demo on 3 CPU nodes: the CPU engine on node 1, 2 learner ranks (EP2, gloo) on nodes 2-3.
# This is what CI runs on the local 3-node cluster (tools/slurm_local.sh).
#   slurm/recipes/cpu_demo.sh --run-dir DIR [--dry-run] [options] [key=value ...]
# Options given here can be overridden by repeating them (e.g. --gpu-mem-gb 141 on H200s);
# slurm/launch.sh --help lists them all. Settings: examples/cpu_demo.yaml.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "$here/../launch.sh" "$here/../../examples/cpu_demo.yaml" \
    --job-name cpu_demo \
    --rollout-nodes 1 --learner-nodes 2 --gpus-per-node 0 --procs-per-node 1 \
    --cpus-per-node 1 --mem-per-node-gb 1 \
    "$@"
