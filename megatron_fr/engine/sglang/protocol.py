"""SGLang's HTTP wire format, written once: request bodies the project sends and strict parsing of
the /generate response.

Every key sent here is a field of SGLang's own request type (sglang 0.5.23,
srt/managers/io_struct.py); tests/unit/test_rollout_protocol.py checks that against the installed
source. The response is validated strictly because the learner trusts it blindly: a behavior
log-prob paired with the wrong token, or a positive "log-prob", silently corrupts the importance
ratio, so a response that breaks the contract is refused with the offending field named
(`meta_info.output_token_logprobs[3][1]`), never repaired. The same holds for the top-K
log-probs asked for with top_logprobs_num (the top-K gate's input): exactly K entries
[logprob, token_id, text|null] per output token, as SGLang's tokenizer manager writes them,
or null for the leading tokens SGLang has none of.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Literal

import numpy as np

from megatron_fr.engine.top_logprobs import TopLogProbs
from megatron_fr.engine.types import (
    FINISH_REASONS,
    GREEDY_TEMPERATURE,
    HEALTH_PATH,
    PAUSE_MODES,
    FinishReason,
    GenerateOutput,
    MalformedResponse,
    PauseMode,
    RoutedExpertsLayout,
    SamplingParams,
    parse_version_spans,
)

__all__ = [
    "FINISH_REASONS",
    "GREEDY_TEMPERATURE",
    "HEALTH_PATH",
    "PAUSE_MODES",
    "FinishReason",
    "GenerateOutput",
    "MalformedResponse",
    "PauseMode",
    "RoutedExpertsLayout",
    "SamplingParams",
    "parse_version_spans",
]

WEIGHT_READBACK_FAMILIES = ("llama", "opt", "granite", "exaone4")
"""Model families whose SGLang 0.5.23 model class defines get_weights_by_name (the others
answer /get_weights_by_name with an error): weights.spot_check reads weights back from these
only; tests/unit/test_weight_transports.py reads them in SGLang's source."""

GENERATE_PATH = "/generate"
PAUSE_GENERATION_PATH = "/pause_generation"
CONTINUE_GENERATION_PATH = "/continue_generation"
INIT_WEIGHTS_UPDATE_GROUP_PATH = "/init_weights_update_group"
DESTROY_WEIGHTS_UPDATE_GROUP_PATH = "/destroy_weights_update_group"
BEGIN_WEIGHT_UPDATE_PATH = "/begin_weight_update"
END_WEIGHT_UPDATE_PATH = "/end_weight_update"
UPDATE_WEIGHTS_FROM_DISTRIBUTED_PATH = "/update_weights_from_distributed"
UPDATE_WEIGHTS_FROM_TENSOR_PATH = "/update_weights_from_tensor"
UPDATE_WEIGHTS_FROM_DISK_PATH = "/update_weights_from_disk"
UPDATE_WEIGHT_VERSION_PATH = "/update_weight_version"
GET_WEIGHTS_BY_NAME_PATH = "/get_weights_by_name"

RunnerSelector = Literal["target", "draft", "all"]


def _version_str(value: str | int, name: str) -> str:
    """SGLang carries weight versions as strings; the project counts them as ints."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise TypeError(f"{name} must be a str or int, got {type(value).__name__}")
    return str(value)


def _optional_version(value: str | int | None) -> str | None:
    return None if value is None else _version_str(value, "weight_version")


def _check_prompt(ids: object, name: str) -> list[int]:
    """`ids` itself, once it is a non-empty list of token ids (else a ValueError)."""
    if not isinstance(ids, list) or not ids:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative int, got {token!r}")
    return ids


def generate_request(
    input_ids: list[int] | list[list[int]],
    sampling: SamplingParams,
    *,
    rid: str | list[str] | None = None,
    routed_experts_start_len: int | None = None,
    top_logprobs_num: int = 0,
) -> dict[str, object]:
    """Body of POST /generate for one prompt or a batch (a list of prompts), token in, token out.

    `logprob_start_len: -1` asks for the log-probs of the OUTPUT tokens only: the behavior
    log-probs the learner needs. A batch shares one `sampling_params` (SGLang broadcasts it); a
    str `rid` for a batch is a prefix SGLang expands per item, a list must give one per prompt.
    `routed_experts_start_len` (None: not asked) asks for the routed experts of positions
    [start, prompt + output - 1): SGLang's return_routed_experts with its start position, which
    must not exceed the prompt's length. `top_logprobs_num` = K > 0 asks for the K most likely
    tokens of every output token's distribution, with their log-probs (SGLang's field; the
    answer's meta_info.output_top_logprobs)."""
    batched = bool(input_ids) and isinstance(input_ids[0], list)
    if batched:
        prompts = [_check_prompt(ids, f"input_ids[{b}]") for b, ids in enumerate(input_ids)]
        if isinstance(rid, list) and len(rid) != len(input_ids):
            raise ValueError(f"rid has {len(rid)} ids for a batch of {len(input_ids)} prompts")
    else:
        prompts = [_check_prompt(input_ids, "input_ids")]
        if isinstance(rid, list):
            raise ValueError("rid must be a str for a single prompt, got a list")
    body: dict[str, object] = {
        "input_ids": input_ids,
        "sampling_params": sampling.to_json(),
        "return_logprob": True,
        "logprob_start_len": -1,
        "return_routed_experts": routed_experts_start_len is not None,
    }
    if routed_experts_start_len is not None:
        shortest = min(map(len, prompts))
        if not 0 <= routed_experts_start_len <= shortest:
            raise ValueError(
                f"routed_experts_start_len {routed_experts_start_len} must be in [0, {shortest}] "
                "(the prompt's length)"
            )
        body["routed_experts_start_len"] = routed_experts_start_len
    if top_logprobs_num < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}")
    if top_logprobs_num:
        body["top_logprobs_num"] = top_logprobs_num
    if rid is not None:
        body["rid"] = rid
    return body


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(mapping: dict, key: str, prefix: str) -> object:
    if key not in mapping:
        raise MalformedResponse(_join(prefix, key), "missing")
    return mapping[key]


def _parse_output_ids(body: dict, prefix: str) -> list[int]:
    path = _join(prefix, "output_ids")
    output_ids = _require(body, "output_ids", prefix)
    if not isinstance(output_ids, list):
        raise MalformedResponse(path, f"expected a list of ints, got {type(output_ids).__name__}")
    for i, token in enumerate(output_ids):
        if not _is_int(token) or token < 0:
            raise MalformedResponse(f"{path}[{i}]", f"expected a token id, got {token!r}")
    return output_ids


def _parse_logprobs(meta: dict, output_ids: list[int], prefix: str) -> list[float]:
    path = _join(prefix, "output_token_logprobs")
    entries = _require(meta, "output_token_logprobs", prefix)
    if not isinstance(entries, list):
        raise MalformedResponse(path, f"expected a list, got {type(entries).__name__}")
    if len(entries) != len(output_ids):
        raise MalformedResponse(
            path, f"has {len(entries)} entries for {len(output_ids)} output_ids"
        )
    logprobs = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 3:
            raise MalformedResponse(f"{path}[{i}]", "expected [logprob, token_id, text|null]")
        logprob, token, text = entry
        if isinstance(logprob, bool) or not isinstance(logprob, int | float):
            raise MalformedResponse(f"{path}[{i}][0]", f"expected a float, got {logprob!r}")
        if not math.isfinite(logprob) or logprob > 0:
            raise MalformedResponse(f"{path}[{i}][0]", f"expected finite <= 0, got {logprob!r}")
        if token != output_ids[i] or not _is_int(token):
            raise MalformedResponse(
                f"{path}[{i}][1]", f"token id {token!r} != output_ids[{i}] = {output_ids[i]}"
            )
        if text is not None and not isinstance(text, str):
            raise MalformedResponse(f"{path}[{i}][2]", f"expected str or null, got {text!r}")
        logprobs.append(float(logprob))
    return logprobs


def _parse_top_logprobs(
    meta: dict, output_ids: list[int], k: int, prefix: str
) -> tuple[TopLogProbs, int]:
    """SGLang's meta_info.output_top_logprobs for top_logprobs_num = k: one entry per output
    token, a list of exactly k entries [logprob, token_id, text|null] (tokenizer_manager.py:
    detokenize_top_logprobs_tokens; JSON turns its tuples into lists), log-probs finite and
    <= 0 (SGLang clamps -inf to the float's smallest value), token ids in int32's range; or
    null for a token SGLang has no top-K of (its row was empty), only in a leading run, the
    one place SGLang's own flat layout allows them (io_struct.py: flat_top_logprobs_layout).
    Returns the rows after that run and its length (SGLang's output_top_logprobs_null_prefix)."""
    path = _join(prefix, "output_top_logprobs")
    if not output_ids and "output_top_logprobs" not in meta:
        return TopLogProbs.of([], [], k), 0  # some of SGLang's abort paths add no log-probs
    rows = _require(meta, "output_top_logprobs", prefix)
    if not isinstance(rows, list) or len(rows) != len(output_ids):
        got = f"{len(rows)} entries" if isinstance(rows, list) else type(rows).__name__
        raise MalformedResponse(
            path, f"expected {len(output_ids)} lists (one per output token), got {got}"
        )
    null_prefix = next((i for i, row in enumerate(rows) if row is not None), len(rows))
    ids, log_probs = [], []
    for i, row in enumerate(rows[null_prefix:], start=null_prefix):
        if row is None:
            raise MalformedResponse(
                f"{path}[{i}]", f"null after a token with its top-{k} (nulls only lead)"
            )
        if not isinstance(row, list) or len(row) != k:
            raise MalformedResponse(f"{path}[{i}]", f"expected {k} entries, got {row!r:.80}")
        for j, entry in enumerate(row):
            where = f"{path}[{i}][{j}]"
            if not isinstance(entry, list) or len(entry) != 3:
                raise MalformedResponse(where, "expected [logprob, token_id, text|null]")
            logprob, token, _ = entry
            if (
                isinstance(logprob, bool)
                or not isinstance(logprob, int | float)
                or not (math.isfinite(logprob) and logprob <= 0)
            ):
                raise MalformedResponse(f"{where}[0]", f"expected finite <= 0, got {logprob!r}")
            if not _is_int(token) or not 0 <= token < 2**31:
                raise MalformedResponse(f"{where}[1]", f"expected a token id, got {token!r}")
            ids.append(token)
            log_probs.append(logprob)
    return TopLogProbs.of(ids, log_probs, k), null_prefix


def _parse_finish_reason(meta: dict, prefix: str) -> FinishReason:
    path = _join(prefix, "finish_reason")
    reason = meta.get("finish_reason")
    if reason is None:
        raise MalformedResponse(path, "missing or null (the request did not finish)")
    if not isinstance(reason, dict):
        raise MalformedResponse(path, f"expected an object, got {type(reason).__name__}")
    kind = reason.get("type")
    if kind not in FINISH_REASONS:
        raise MalformedResponse(f"{path}.type", f"expected one of {FINISH_REASONS}, got {kind!r}")
    return kind


def _parse_version(meta: dict, prefix: str) -> str:
    path = _join(prefix, "weight_version")
    version = meta.get("weight_version")
    if isinstance(version, str):
        return version
    if _is_int(version):
        return str(version)
    raise MalformedResponse(path, f"expected a string, got {version!r}")


def _parse_one(body: object, prefix: str, top_logprobs_num: int = 0) -> GenerateOutput:
    if not isinstance(body, dict):
        raise MalformedResponse(prefix or "response", "expected a JSON object")
    output_ids = _parse_output_ids(body, prefix)
    meta_prefix = _join(prefix, "meta_info")
    meta = _require(body, "meta_info", prefix)
    if not isinstance(meta, dict):
        raise MalformedResponse(meta_prefix, "expected an object")
    logprobs = _parse_logprobs(meta, output_ids, meta_prefix)
    finish_reason = _parse_finish_reason(meta, meta_prefix)
    version = _parse_version(meta, meta_prefix)
    prompt_tokens = meta.get("prompt_tokens")
    if prompt_tokens is not None and (not _is_int(prompt_tokens) or prompt_tokens < 0):
        raise MalformedResponse(
            _join(meta_prefix, "prompt_tokens"), f"expected an int >= 0, got {prompt_tokens!r}"
        )
    top, top_from = None, 0
    if top_logprobs_num:
        top, top_from = _parse_top_logprobs(meta, output_ids, top_logprobs_num, meta_prefix)
    return GenerateOutput(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=finish_reason,
        weight_version=version,
        token_versions=parse_version_spans(meta, len(output_ids), version, meta_prefix),
        routed_experts=meta.get("routed_experts"),
        prompt_tokens=prompt_tokens,
        top_logprobs=top,
        top_logprobs_from=top_from,
    )


def decode_routed_experts(
    payload: object, rows: int, layout: RoutedExpertsLayout, path: str = "meta_info.routed_experts"
) -> np.ndarray:
    """SGLang's base64 int32 payload as an int32 array [rows, num_layers, top_k], checked:
    the byte count must be exactly that shape's and every id below num_experts."""
    if not isinstance(payload, str):
        raise MalformedResponse(path, f"expected base64 text, got {type(payload).__name__}")
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise MalformedResponse(path, f"not base64 ({error})") from error
    width = layout.num_layers * layout.top_k
    if len(raw) != rows * width * 4:
        raise MalformedResponse(
            path,
            f"{len(raw)} bytes, expected {rows} positions x {layout.num_layers} layers x "
            f"top-{layout.top_k} x 4 (int32) = {rows * width * 4}",
        )
    experts = np.frombuffer(raw, dtype="<i4").astype(np.int32)
    experts = experts.reshape(rows, layout.num_layers, layout.top_k)
    if experts.size and (experts.min() < 0 or experts.max() >= layout.num_experts):
        position = int(np.argwhere((experts < 0) | (experts >= layout.num_experts))[0][0])
        raise MalformedResponse(
            path, f"position {position}: expert ids outside [0, {layout.num_experts})"
        )
    return experts


def parse_generate_response(body: object, top_logprobs_num: int = 0) -> GenerateOutput:
    """Validate one finished, non-streamed /generate response, asked for `top_logprobs_num`
    top log-probs per token (0: none); raises MalformedResponse."""
    return _parse_one(body, "", top_logprobs_num)


def parse_generate_responses(body: object, count: int) -> list[GenerateOutput]:
    """Validate the response to a batch of `count` prompts: a list, one response per prompt."""
    if not isinstance(body, list):
        raise MalformedResponse("response", f"expected a list of {count} responses")
    if len(body) != count:
        raise MalformedResponse("response", f"has {len(body)} responses for {count} prompts")
    return [_parse_one(item, f"[{i}]") for i, item in enumerate(body)]


# Control and weight-update bodies. Every optional field is sent explicitly so the behaviour does
# not depend on SGLang's defaults (e.g. UpdateWeightVersionReqInput aborts by default).


def init_weights_update_group_request(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "nccl",
) -> dict[str, object]:
    """Body of /init_weights_update_group: the server's ranks join a process group with the
    trainer (rank 0) at `rank_offset`..; "gloo" is a legitimate backend for the CPU engine."""
    if world_size < 2 or not 1 <= rank_offset < world_size:
        raise ValueError(
            f"rank_offset {rank_offset} must be in [1, world_size {world_size}): rank 0 is the "
            "trainer"
        )
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def destroy_weights_update_group_request(group_name: str) -> dict[str, object]:
    return {"group_name": group_name}


def begin_weight_update_request(selector: RunnerSelector = "all") -> dict[str, object]:
    """Body of /begin_weight_update. sglang 0.5.23 refuses update_weights_from_distributed and
    update_weights_from_tensor outside a begin/end weight-update session."""
    return {"selector": selector}


def end_weight_update_request() -> dict[str, object]:
    return {}


def update_weights_from_distributed_request(
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    *,
    group_name: str,
    flush_cache: bool = True,
    weight_version: str | int | None = None,
    abort_all_requests: bool = False,
    load_format: str | None = None,
) -> dict[str, object]:
    """Body of /update_weights_from_distributed: metadata of the tensors the trainer is about to
    broadcast, in broadcast order. dtypes are torch attribute names ("bfloat16"), which SGLang
    resolves with getattr(torch, dtype)."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) must have "
            "the same length"
        )
    for i, dtype in enumerate(dtypes):
        if not isinstance(dtype, str) or not dtype or dtype.startswith("torch."):
            raise ValueError(
                f'dtypes[{i}] must be a torch dtype name like "bfloat16", got {dtype!r}'
            )
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(shape) for shape in shapes],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": _optional_version(weight_version),
        "load_format": load_format,
    }


def update_weights_from_tensor_request(
    serialized_named_tensors: list[str],
    *,
    load_format: str | None = None,
    flush_cache: bool = True,
    weight_version: str | int | None = None,
    abort_all_requests: bool = False,
) -> dict[str, object]:
    """Body of /update_weights_from_tensor: one base64 payload per server TP rank."""
    if not serialized_named_tensors or not all(
        isinstance(item, str) for item in serialized_named_tensors
    ):
        raise ValueError("serialized_named_tensors must be a non-empty list of base64 strings")
    return {
        "serialized_named_tensors": list(serialized_named_tensors),
        "load_format": load_format,
        "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests,
        "weight_version": _optional_version(weight_version),
    }


def update_weights_from_disk_request(
    model_path: str,
    *,
    weight_version: str | int | None = None,
    abort_all_requests: bool = False,
    flush_cache: bool = True,
) -> dict[str, object]:
    return {
        "model_path": model_path,
        "abort_all_requests": abort_all_requests,
        "flush_cache": flush_cache,
        "weight_version": _optional_version(weight_version),
    }


def pause_generation_request(mode: PauseMode = "abort") -> dict[str, object]:
    """Body of /pause_generation. "abort" returns running requests with finish_reason "abort"
    (the client continues them); "retract" and "in_place" keep them on the server."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return {"mode": mode}


def continue_generation_request() -> dict[str, object]:
    return {}


def update_weight_version_request(
    new_version: str | int, abort_all_requests: bool = False
) -> dict[str, object]:
    return {
        "new_version": _version_str(new_version, "new_version"),
        "abort_all_requests": abort_all_requests,
    }


def get_weights_by_name_request(name: str, truncate_size: int) -> dict[str, object]:
    """Body of /get_weights_by_name: the first `truncate_size` values of tensor `name` (SGLang
    reads them back only for some model types: weights/sync.py's spot check)."""
    return {"name": name, "truncate_size": truncate_size}
