#!/usr/bin/env bash
# Create (or update) the project's CPU virtual environment in .venv, idempotently.
#   bash tools/setup_cpu.sh        # then use .venv/bin/python, .venv/bin/megatron-fr
# A second run with everything present finishes in a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
MEGATRON_CORE_VERSION=0.19.2
# SGLang's server needs CUDA; on CPU it is installed without dependencies only so the tests can
# read its request dataclasses (srt/managers/io_struct.py) and check the client against them.
SGLANG_VERSION=0.5.23

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

stamp=.venv/.megatron-fr-cpu-installed
wanted=$(cat requirements-cpu.txt pyproject.toml tools/setup_cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "setup_cpu: .venv is up to date"
    exit 0
fi
pip_install -r requirements-cpu.txt
# megatron-core 0.19.2 declares Requires-Python >= 3.12 but ships a wheel that works on 3.11.
pip_install --no-deps --ignore-requires-python "megatron-core==${MEGATRON_CORE_VERSION}"
pip_install --no-deps "sglang==${SGLANG_VERSION}"
pip_install --no-deps -e .
echo "$wanted" > "$stamp"
echo "setup_cpu: .venv ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
