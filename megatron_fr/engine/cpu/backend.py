"""The project's CPU engine: one process on this interpreter, speaking SGLang's protocol
(engine/cpu/server.py), so it is driven through SGLang's wire."""

from __future__ import annotations

import os
import sys

from megatron_fr.engine.backend import EngineBackend, HasCuda, check_nothing
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.sglang.wire import SGLANG_WIRE


def server_command(
    cfg: ServerLaunchConfig, has_cuda: HasCuda, watch_parent: bool = True
) -> list[str]:
    """argv of the CPU engine, which runs one process with no parallel layout and takes no other
    flags: settings it cannot honour are refused rather than silently dropped. With
    watch_parent the engine exits when this process does (it was started as a child)."""
    unsupported = {
        name: getattr(cfg, name)
        for name in ("tp_size", "ep_size", "dp_size", "nnodes")
        if getattr(cfg, name) != 1
    }
    if cfg.enable_dp_attention:
        unsupported["enable_dp_attention"] = True
    if cfg.gpu_ids:
        unsupported["gpu_ids"] = cfg.gpu_ids
    if cfg.extra_args:
        unsupported["extra_args"] = cfg.extra_args
    if unsupported:
        detail = ", ".join(f"{name}={value}" for name, value in unsupported.items())
        raise ValueError(f"the CPU engine runs one single-device process; unsupported: {detail}")
    command = [sys.executable, "-m", "megatron_fr.engine.cpu.server"]
    command += ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port)]
    command += ["--threads", str(cfg.cpu_threads)]
    if cfg.return_routed_experts:
        command.append("--enable-return-routed-experts")
    return [*command, "--parent-pid", str(os.getpid())] if watch_parent else command


def server_env(environ: dict[str, str], has_cuda: HasCuda) -> dict[str, str]:
    """The launcher's environment as it is."""
    return environ


BACKEND = EngineBackend("cpu", SGLANG_WIRE, server_command, server_env, check_nothing)
