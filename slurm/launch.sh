#!/usr/bin/env bash
# Submit a recipe as a Slurm job: first R nodes inference servers, the next L nodes learners.
#   slurm/launch.sh RECIPE --run-dir DIR --rollout-nodes R --learner-nodes L \
#       [--gpus-per-node G --gpu-mem-gb 80 --model PRESET] [--time 04:00:00] \
#       [--container-image IMG] [--dry-run] [dotted.key=value ...]
# Checks the recipe and the learner layout (megatron_fr/launch/plan.py) before anything is
# allocated, writes RUN_DIR/slurm/job.sbatch (#SBATCH lines + settings + slurm/job.sh) and
# runs sbatch; --dry-run prints the plan and every command instead. --help lists the options.
# The interpreter: $MFR_PYTHON, else the repository's .venv, else python3 on PATH.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${MFR_PYTHON:-}
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; else python=python3; fi
fi
exec "$python" -m megatron_fr.launch.submit "$@"
