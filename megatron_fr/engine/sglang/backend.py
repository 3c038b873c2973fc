"""SGLang: on GPUs with this interpreter's `sglang.launch_server`, on a machine without CUDA in
its own CPU environment through the import shims (engine/sglang/launch.py)."""

from __future__ import annotations

import sys

from megatron_fr.engine.backend import EngineBackend, HasCuda
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.sglang import launch
from megatron_fr.engine.sglang.wire import SGLANG_WIRE

SGLANG_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"}
"""What every SGLang server started by the project runs with, unless set otherwise already
(engine/launcher.py's docstring: /health then says only that the server is up)."""


def server_command(
    cfg: ServerLaunchConfig, has_cuda: HasCuda, watch_parent: bool = True
) -> list[str]:
    """argv of SGLang for `cfg`: `python -m sglang.launch_server` on GPUs; on a machine without
    CUDA, real SGLang in its CPU environment with the CPU flags (ValueError naming the remedy
    when that environment is missing). SGLang's processes are stopped through their process
    group, so `watch_parent` does not apply."""
    if has_cuda():
        return [sys.executable, "-m", "sglang.launch_server", *launch_args(cfg)]
    python = launch.cpu_interpreter(cfg.python)
    problem = launch.cpu_problem(python)
    if problem is not None or python is None:
        raise ValueError(f"SGLang on a machine without CUDA: {problem}")
    return launch.cpu_command(python, launch_args(cfg))


def launch_args(cfg: ServerLaunchConfig) -> list[str]:
    """sglang.launch_server's flags for `cfg`."""
    cmd = ["--model-path", cfg.model_path]
    cmd += ["--tp-size", str(cfg.tp_size), "--ep-size", str(cfg.ep_size)]
    if cfg.enable_dp_attention:  # 0.5.23's spelling of "--dp-size N --enable-dp-attention"
        cmd += ["--attn-dp-size", str(cfg.dp_size)]
    elif cfg.dp_size > 1:
        cmd += ["--dp-size", str(cfg.dp_size)]
    cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    cmd += ["--host", cfg.host, "--port", str(cfg.port)]
    if cfg.nnodes > 1:
        cmd += ["--nnodes", str(cfg.nnodes), "--node-rank", str(cfg.node_rank)]
        if not cfg.dist_init_addr:  # the validator refused it already, unless model_construct()
            raise ValueError(f"dist_init_addr is required for nnodes {cfg.nnodes}")
        cmd += ["--dist-init-addr", cfg.dist_init_addr]
    if cfg.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    # Warmup sends a request before /health turns green; the client's own traffic warms it.
    if cfg.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    cmd.append("--skip-server-warmup")
    return cmd + list(cfg.extra_args)


def server_env(environ: dict[str, str], has_cuda: HasCuda) -> dict[str, str]:
    """`environ` with SGLANG_ENV (a value it has wins), and on CPU SGLang's CPU settings."""
    env = SGLANG_ENV | environ
    return env if has_cuda() else launch.cpu_env(env)


def check_machine(where: str, remedy: str, python: str | None, has_cuda: HasCuda) -> None:
    """SGLang needs CUDA GPUs, or SGLang's CPU environment (`python`, else the repository's
    .venv-sglang)."""
    if has_cuda():
        return
    problem = launch.cpu_problem(launch.cpu_interpreter(python))
    if problem is not None:
        raise ValueError(
            f"{where} is 'sglang', which needs CUDA GPUs, and this machine has none, nor "
            f"SGLang's CPU environment: {problem}; or {remedy} (the project's CPU engine)"
        )


BACKEND = EngineBackend("sglang", SGLANG_WIRE, server_command, server_env, check_machine)
