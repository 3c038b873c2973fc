"""How the project starts real SGLang on a machine without CUDA: in SGLang's own environment,
through the import shims, with the flags SGLang's CPU path needs.

On a GPU machine the launcher runs `python -m sglang.launch_server` with the interpreter
running the project (engine/launcher.py). On a CPU machine SGLang lives in an environment of
its own (tools/setup_sglang_cpu.sh makes .venv-sglang: the CPU torch, sglang 0.5.23 and the
packages it imports, without its CUDA requirements), so the interpreter is a setting
(ServerLaunchConfig.python; None: the repository's .venv-sglang), and the server starts
through engine/sglang/cpu_shims.py, which makes SGLang's imports of CUDA-only packages succeed
and fail loudly if one of them is ever called. The project's .venv also holds sglang, without
its dependencies, only so that tests can read its source: it cannot serve.

CPU_FLAGS, each because SGLang's defaults are for GPUs:
- `--device cpu --attention-backend torch_native`: SGLang's CPU attention default
  (intel_amx) needs sgl_kernel's CPU operators, which have no build on PyPI;
- `--disable-cuda-graph`: no graphs to capture;
- `--max-total-tokens 8192 --max-running-requests 16`: the KV cache is otherwise sized from
  `--mem-fraction-static` of the machine's memory (6.3 GB of cache for a tiny model at 0.3);
- `--skip-tokenizer-init`: the project sends and reads token ids only, and the CPU tests'
  tiny models have no tokenizer.
SGLANG_USE_CPU_ENGINE=1 in its environment: without it `--device cpu` does not select
SGLang's CPU code (srt/utils/common.py: is_cpu), and model construction imports vLLM's CUDA
ops. The repository goes on PYTHONPATH for the shim module, as for vLLM's gloo extension.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
LOCAL_VENV = REPO / ".venv-sglang"
"""Where tools/setup_sglang_cpu.sh puts SGLang for CPU machines, next to the project's .venv."""
SHIM_MODULE = "megatron_fr.engine.sglang.cpu_shims"
CPU_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--device", "cpu"),
    ("--attention-backend", "torch_native"),
    ("--disable-cuda-graph",),
    ("--max-total-tokens", "8192"),
    ("--max-running-requests", "16"),
    ("--skip-tokenizer-init",),
)
"""SGLang's flags on CPU (module docstring), each with its value; a flag given already is kept
as given."""
CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1"}
SETUP = "bash tools/setup_sglang_cpu.sh"


def cpu_interpreter(python: str | None) -> str | None:
    """The interpreter SGLang runs under on a CPU machine: `python` if given, else the
    repository's .venv-sglang where it is, else None."""
    if python:
        return python
    local = LOCAL_VENV / "bin" / "python"
    return str(local) if local.exists() else None


def cpu_problem(python: str | None) -> str | None:
    """Why `python` cannot serve SGLang on this CPU machine, or None when it can: it must have
    sglang and its server's own runtime (uvloop, zmq), which the project's .venv lacks. Looked
    up, not imported (that takes seconds)."""
    if python is None:
        return f"no SGLang CPU environment ({SETUP} makes {LOCAL_VENV.name})"
    found = (
        "import importlib.util as u, sys; "
        "sys.exit(any(u.find_spec(m) is None for m in ('sglang', 'uvloop', 'zmq')))"
    )
    try:
        missing = subprocess.run([python, "-c", found], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run {python} ({error})"
    if missing:
        return f"{python} cannot serve SGLang ({SETUP} makes {LOCAL_VENV.name})"
    return None


def cpu_command(python: str, launch_args: list[str]) -> list[str]:
    """argv of SGLang's server on CPU: `launch_args` (sglang.launch_server's flags) through the
    shims, with the CPU_FLAGS not given already."""
    command = [python, "-m", SHIM_MODULE, *launch_args]
    for flag in CPU_FLAGS:
        if flag[0] not in launch_args:
            command += flag
    return command


def cpu_env(base: dict[str, str]) -> dict[str, str]:
    """`base` with CPU_ENV (a value `base` has wins) and the repository on PYTHONPATH."""
    env = CPU_ENV | base
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
    return env
