#!/usr/bin/env bash
# Create (or update) the real SGLang server's own CPU virtual environment in .venv-sglang,
# idempotently: sglang 0.5.23 serves the project's tests of the flagship's inference engine on a
# CPU machine (tests/sglang). It lives apart from .venv because it pins its own versions of
# transformers and friends; the project talks to it over HTTP and through the weight-update
# group only.
#   bash tools/setup_sglang_cpu.sh   # then megatron-fr serve --engine sglang ... on a CPU machine
# A second run with everything present takes a second.
#
# sglang's own requirements are a CUDA 13 stack (torch 2.14.1 with CUDA, flashinfer, its CUDA
# kernels): pip must never resolve them. So torch 2.13.0 (the project's own torch, the CPU
# build) is installed first with its dependencies, then sglang and the packages it imports on
# the CPU path WITHOUT dependencies, every one pinned below. What sglang imports that has no CPU
# build (sgl_kernel, torchvision's CUDA operators) is made importable at the server's start by
# megatron_fr/engine/sglang/cpu_shims.py, which says why each shim exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
# sglang 0.5.23 and what it imports on CPU (its own pins where it has them: transformers,
# tokenizers, xgrammar, openai, compressed-tensors, apache-tvm-ffi, sentencepiece, soundfile),
# with their own dependencies, as `pip install --dry-run --report` resolved them beside torch
# 2.13.0. triton is imported at module level by sglang's layers (about 1 GB; no kernel of it
# runs on CPU); torchvision by its multimodal configuration code.
PINNED="
aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7
annotated-types==0.8.0 anyio==4.16.0 apache-tvm-ffi==0.1.11 asttokens==3.0.2 attrs==26.1.0
certifi==2026.10.19.post1 cffi==2.1.1 charset-normalizer==3.5.3 click==8.5.1
compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 einops==0.8.2 executing==2.3.0
fastapi==0.165.0 frozenlist==1.8.0 gguf==0.19.0 h11==0.16.0 hf-xet==1.8.0 httpcore==1.0.9
httpcore2==2.17.0 httpx==0.29.0 httpx2==2.17.0 huggingface_hub==1.33.0 idna==3.21
ipython==9.19.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 loguru==0.7.3 markdown-it-py==4.3.0
matplotlib-inline==0.2.2 mdurl==0.1.2 msgspec==0.23.0 multidict==7.2.1 numpy==2.4.6
openai==2.8.0 opentelemetry-api==1.45.3 orjson==3.13.0 packaging==26.4 parso==0.8.7
partial-json-parser==0.2.1.1.post7 pexpect==4.9.0 pillow==13.0.0 prompt_toolkit==3.0.53
propcache==0.5.4 psutil==7.2.2 ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1
pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5 Pygments==2.21.0 python-multipart==0.0.34
PyYAML==6.0.4 pyzmq==27.3.0 referencing==0.37.0 regex==2026.12.2 requests==2.34.2 rich==15.0.0
rpds-py==2026.9.1 safetensors==0.8.0 sentencepiece==0.2.1 setproctitle==1.3.8 shellingham==1.5.4
sniffio==1.3.1 soundfile==0.13.1 stack-data==0.6.3 starlette==1.10.0 tokenizers==0.23.2
torchvision==0.28.0 tqdm==4.70.1 traitlets==5.16.1 transformers==5.19.0 triton==3.9.0
truststore==0.10.5 typer==0.29.2 typing-inspection==0.4.5 urllib3==2.8.0 uvicorn==0.55.0
uvloop==0.23.0 wcwidth==0.9.5 xgrammar==0.2.7 yarl==1.25.1
"

if [ ! -x .venv-sglang/bin/python ]; then
    "$PYTHON" -m venv .venv-sglang
fi
pip() { .venv-sglang/bin/python -m pip --disable-pip-version-check "$@"; }

stamp=.venv-sglang/.megatron-fr-sglang-installed
wanted=$(sha256sum tools/setup_sglang_cpu.sh | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
    echo "setup_sglang_cpu: .venv-sglang is up to date"
    exit 0
fi
pip install --quiet "torch==${TORCH_VERSION}"
case "$(.venv-sglang/bin/python -c 'import torch; print(torch.__version__)')" in
    *+cpu) ;;
    *) echo "setup_sglang_cpu: torch ${TORCH_VERSION} is not the CPU build" >&2; exit 1 ;;
esac
# shellcheck disable=SC2086  # one word per requirement
pip install --quiet --no-deps "sglang==${SGLANG_VERSION}" $PINNED
.venv-sglang/bin/python -c "import torch; assert not torch.version.cuda, torch.version.cuda"
PYTHONPATH=. .venv-sglang/bin/python -m megatron_fr.engine.sglang.cpu_shims --check
echo "$wanted" > "$stamp"
