"""What an inference server is, from its own GET /server_info: one code path identifies, sizes
and checks every server, SGLang, vLLM or the project's CPU engine.

SGLang 0.5.23 answers /server_info with one flat object (srt/entrypoints/http_server.py:
server_info -> srt/utils/common.py: build_server_info): its resolved server arguments
(ServerArgs.resolved_dict: tp_size, dp_size, pp_size, attn_dp_size, enable_dp_attention,
enable_return_routed_experts, ...), then "version" (SGLang's) and "frontend". The CPU engine
answers the same fields for itself and names itself in ENGINE_FIELD. Anything else (a 404: a
router or another kind of server; an object without those fields) is refused with the reason:
a server sized by guesswork would join the weight-update group at the wrong ranks.

vLLM 0.32 answers /server_info only with VLLM_SERVER_DEV_MODE=1 (which the project's RL routes
need anyway; engine/vllm/launch.py): {"vllm_config", "vllm_env", "system_env"}, the config as
JSON when asked with ?config_format=json (entrypoints/serve/dev/server_info/api_router.py);
its parallel_config holds tensor_parallel_size, pipeline_parallel_size and data_parallel_size.
SGLang and the CPU engine ignore the query.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatron_fr.config.engine_kinds import EngineKind
from megatron_fr.engine.http import SERVER_INFO_PATH, EngineRequestError, get_json

VLLM_CONFIG_FIELD = "vllm_config"
"""The /server_info field only vLLM answers (module docstring)."""
INFO_QUERY = "?config_format=json"
ENGINE_FIELD = "engine"
"""The /server_info field by which the CPU engine names itself (SGLang has none of that name)."""
CPU_ENGINE = "megatron-fr-cpu"
INSTANCE_FIELD = "instance_id"
"""The /server_info field by which the CPU engine tells its process from every other one (a
random id drawn at its start): one engine reached under two URLs says the same id. SGLang
has none; its engines are told apart by address alone (rollout/supervisor.py)."""
RETRY_S = 0.5
"""How often a server that does not answer yet is asked again (identify's patience_s)."""


class UnknownServer(EngineRequestError):
    """A server that does not say what it is on /server_info, or says something unusable."""


@dataclass(frozen=True)
class ServerInfo:
    """What the weight sync and the rollout side need to know of one server."""

    url: str
    kind: EngineKind
    tp_size: int
    """Ranks the server has in a weight-update group (rank_offset + tp_rank)."""
    pp_size: int
    dp_replicas: int
    """Whole data-parallel replicas (dp_size; attention DP lives inside one replica)."""
    routed_experts: bool
    """enable_return_routed_experts: requests may ask for their routed experts."""
    instance: str | None = None
    """The server process's own id (INSTANCE_FIELD), where it gives one."""


def identify(url: str, timeout_s: float, patience_s: float = 0.0) -> ServerInfo:
    """GET /server_info and read it; a server that does not answer at all is asked again until
    `patience_s` has passed (it may still be loading). UnknownServer when it answers but does
    not identify itself, EngineRequestError when it never answers."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            return parse_server_info(url, get_json(url, SERVER_INFO_PATH + INFO_QUERY, timeout_s))
        except UnknownServer:
            raise
        except EngineRequestError as error:
            if error.status == 404:
                raise UnknownServer(
                    f"{url} answers 404 on GET {SERVER_INFO_PATH}, so it is neither SGLang, "
                    "vLLM started with VLLM_SERVER_DEV_MODE=1, nor the project's CPU engine (a "
                    "router, or another kind of server?): give the URLs of the servers themselves",
                    404,
                ) from error
            if error.status is not None or time.monotonic() + RETRY_S > deadline:
                raise
        time.sleep(RETRY_S)


def parse_server_info(url: str, info: object) -> ServerInfo:
    """A /server_info answer read (module docstring); UnknownServer naming the field."""
    where = f"{url}{SERVER_INFO_PATH}"
    if not isinstance(info, dict):
        raise UnknownServer(f"{where}: expected a JSON object, got {str(info)[:200]!r}")
    if isinstance(info.get(VLLM_CONFIG_FIELD), dict):
        return _vllm_info(url, info[VLLM_CONFIG_FIELD], where)
    if info.get(ENGINE_FIELD) == CPU_ENGINE:
        kind: EngineKind = "cpu"
    elif "version" in info and ENGINE_FIELD not in info:
        kind = "sglang"
    else:
        raise UnknownServer(
            f"{where}: neither SGLang's answer (no 'version'), vLLM's (no {VLLM_CONFIG_FIELD!r} "
            f"object) nor the CPU engine's ({ENGINE_FIELD}={CPU_ENGINE!r}); got keys "
            f"{sorted(info)[:20]}"
        )
    # 0.5.23 resolves the old "--dp-size N --enable-dp-attention" to attn_dp_size N, dp_size 1
    # (arg_groups/parallel_hook.py): dp_size then counts whole replicas; an older server that
    # reports enable_dp_attention without attn_dp_size counted attention groups in dp_size.
    old_spelling = info.get("enable_dp_attention") and "attn_dp_size" not in info
    return ServerInfo(
        url=url,
        kind=kind,
        tp_size=_size(info, "tp_size", where, required=True),
        pp_size=_size(info, "pp_size", where),
        dp_replicas=1 if old_spelling else _size(info, "dp_size", where),
        routed_experts=info.get("enable_return_routed_experts") is True,
        instance=str(info[INSTANCE_FIELD])[:200] if INSTANCE_FIELD in info else None,
    )


def _vllm_info(url: str, config: dict, where: str) -> ServerInfo:
    """vLLM's answer: its sizes from vllm_config.parallel_config (module docstring). Routed
    experts are not read from vLLM (engine/vllm/wire.py)."""
    parallel = config.get("parallel_config")
    if not isinstance(parallel, dict):
        raise UnknownServer(f"{where}: {VLLM_CONFIG_FIELD}.parallel_config is not an object")
    inner = f"{where} {VLLM_CONFIG_FIELD}.parallel_config"
    return ServerInfo(
        url=url,
        kind="vllm",
        tp_size=_size(parallel, "tensor_parallel_size", inner, required=True),
        pp_size=_size(parallel, "pipeline_parallel_size", inner),
        dp_replicas=_size(parallel, "data_parallel_size", inner),
        routed_experts=False,
    )


def _size(info: dict, name: str, where: str, required: bool = False) -> int:
    value = info.get(name)
    if value is None and not required:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnknownServer(f"{where}: {name} must be a positive int, got {value!r:.80}")
    return value
