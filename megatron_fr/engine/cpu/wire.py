"""The CPU server's wire format: validation of request bodies, and SGLang's /generate answer.

A malformed request becomes a BadRequest (HTTP 400) naming the field and the reason before any
work starts, never a 500 or a silently different request. Field names are SGLang's (sglang
0.5.23: GenerateReqInput in srt/managers/io_struct.py, SamplingParams in
srt/sampling/sampling_params.py). A null value means "absent", as in SGLang. Fields the CPU
engine does not implement are accepted only at SGLang's default value, so a request never
means one thing on SGLang and another here; any other name is refused.

Routed experts (return_routed_experts, routed_experts_start_len) are answered as SGLang answers
them: meta_info.routed_experts = base64 of the C-order int32 array [positions, layers, top_k]
(srt/managers/detokenizer_manager.py: _b64_encode_per_request), one flag and start for every
prompt of a batch (GenerateReqInput.__getitem__ copies them to each item).

Top-K log-probs (top_logprobs_num = K > 0, at most TOP_LOGPROBS_LIMIT) are answered as SGLang's
tokenizer manager writes them without return_flat_raw_output_top_logprobs
(add_logprob_to_meta_info): meta_info.output_top_logprobs = per output token, K entries
[logprob, token_id, null], and meta_info.input_top_logprobs = [] (logprob_start_len -1 asks
for no prompt position).

The answer has SGLang's fields: meta_info.input_token_logprobs ([]: logprob_start_len -1) and
output_token_logprobs_length beside the output log-probs (tokenizer_manager.py:
add_logprob_to_meta_info, which SGLang runs for every request with return_logprob), and "text"
only where the engine has a tokenizer: SGLang with --skip-tokenizer-init answers output_ids and
meta_info alone (tokenizer_manager.py: _handle_batch_output, BatchTokenIDOutput).

The answer carries SGLang's per-token version spans (srt/utils/weight_versions.py:
add_weight_versions_to_meta_info): meta_info.weight_versions = [{"version", "start", "end"}]
tiling the output tokens, and meta_info.weight_version = the last span's version. A request
aborted before its first step gets the answer SGLang gives one aborted in its waiting queue
(waiting_abort_response: no token, no routed experts).

What one request may cost is bounded before any prompt is tokenised or read token by token
(PromptLimits: prompts per request, tokens of a prompt, characters of a text prompt, and the
log-probs its answer may carry: every prompt's most output tokens x (1 + top_logprobs_num),
summed over the batch, the server's --max-request-logprobs). An answer's per-token lists are
written to JSON entry by entry (answer_json), so encoding a large one holds no other thread
for long.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_fr.engine.cpu.engine import Output, Sampling, prompt_too_long

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Tensor dtypes a weight-update bucket may carry (torch attribute names, as SGLang sends)."""
TEXT_MARGIN = 4
"""Text prompts are refused above context x longest token x this many characters, before
tokenising (a normaliser may merge characters, hence the margin)."""
SAMPLING_SEED_RANGE = (-(2**63), 2**63 - 1)
"""SGLang's SamplingParams.verify bounds."""
MAX_VERSION_CHARS = 256
"""Longest weight version label: it is echoed in every /generate answer (per token span)."""
MAX_STOP_TOKEN_IDS = 4096
"""Most stop token ids one request may give: each is looked up at every step."""
MAX_GROUP_WORLD_SIZE = 65536
"""Most ranks of a weight-update group (a learner's senders and every engine's TP ranks)."""
JOIN_BACKENDS = ("gloo",)
"""Weight-update groups the CPU engine joins (NCCL needs CUDA; SGLang's other backends none
of the project's learners speak): any other is refused before a connection is tried."""
HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_-]{1,63})*\.?$"
)
"""A DNS host name (letters, digits, hyphens, underscores; dot-separated labels)."""
TOP_LOGPROBS_LIMIT = 128
"""The most top log-probs per token one request may ask for: what SGLang's disaggregated
serving carries per token (srt/disaggregation/utils.py: max_top_logprobs_num = 128), and what
bounds the answer's size (K entries per output token)."""

GENERATE_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_routed_experts",
    "routed_experts_start_len",
    "top_logprobs_num",
)
"""/generate fields the engine implements."""
GENERATE_IGNORED = {
    "return_logprob": (bool, list),  # output log-probs are always returned (a list: per item)
    "return_text_in_logprobs": bool,  # the text slot of each log-prob entry is null
    "log_metrics": bool,
    "no_logs": bool,
}
"""/generate fields of any value of this type that change nothing the engine returns."""
GENERATE_DEFAULT_ONLY = {
    "logprob_start_len": -1,
    "stream": False,
    "return_hidden_states": False,
}
"""/generate fields the engine does not implement: accepted at SGLang's default only."""

SAMPLING_IGNORED = {
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "no_stop_trim": bool,
    "stream_interval": int,
}
"""Sampling fields that only shape SGLang's detokenized text or streaming."""
SAMPLING_DEFAULT_ONLY = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
}
"""Sampling fields the engine does not implement: accepted at SGLang's default only."""


class BadRequest(ValueError):
    """Answered with HTTP 400 and the message."""


@dataclass(frozen=True)
class PromptLimits:
    """What one /generate may carry, checked before any prompt is tokenised or read token by
    token: a request never costs more than the server can serve."""

    max_prompts: int
    """Prompts per request (a batch)."""
    context_length: int
    """A prompt of this many tokens or more is refused (the model's context)."""
    max_text_chars: int
    """A text prompt longer than this cannot fit the context, whatever its tokenisation."""
    max_request_logprobs: int = 2**21
    """Log-probs one request's answer may carry (request_logprobs): what bounds the memory
    and time its answer takes (the server's --max-request-logprobs)."""

    @classmethod
    def of(
        cls,
        tokenizer: PreTrainedTokenizerBase | None,
        context_length: int,
        max_prompts: int,
        max_request_logprobs: int = 2**21,
    ) -> PromptLimits:
        """The limits of a model: the longest entry of the tokenizer's vocabulary bounds the
        characters one token stands for (byte-level vocabularies write one character per
        byte), TEXT_MARGIN times over."""
        longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer else 1
        chars = context_length * longest * TEXT_MARGIN
        return cls(max_prompts, context_length, chars, max_request_logprobs)


@dataclass(frozen=True)
class GenerateJob:
    """One prompt of a /generate request: token ids, or text the server tokenizes."""

    prompt: list[int] | str
    sampling: Sampling
    rid: str
    routed_experts_start: int | None = None
    """The first position whose routed experts the answer carries; None: not asked."""
    top_logprobs_num: int = 0
    """K: the answer carries every output token's top K log-probs; 0: not asked."""


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def field(body: dict, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    """`body[name]` checked against `kind` (a bool is not an int, an int is a float); null or
    absent gives `default`, or BadRequest when the field is required."""
    value = body.get(name)
    if value is None:
        if default is ...:
            raise BadRequest(f"missing field {name!r}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = any(
        _is_number(value) if k is float else is_int(value) if k is int else isinstance(value, k)
        for k in kinds
    )
    if not ok:
        raise BadRequest(
            f"field {name!r} must be {_kind_name(kind)}, got {type(value).__name__} {value!r:.80}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"field {name!r} must be finite, got {value}")
    return value


def version_field(body: dict, name: str, default: Any = ...) -> str | None:
    """A weight version: SGLang carries strings; ints are accepted and written as strings.
    At most MAX_VERSION_CHARS of text."""
    value = field(body, name, (str, int), default)
    if value is None:
        return None
    version = _text(str(value), name)
    if len(version) > MAX_VERSION_CHARS:
        raise BadRequest(f"field {name!r} has {len(version)} characters, past {MAX_VERSION_CHARS}")
    return version


def _text(value: str, where: str) -> str:
    """`value`, refused when it holds a lone surrogate (JSON's \\ud800 escaped alone): no
    text, which neither a tokenizer nor a UTF-8 answer can carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest(
            f"{where} holds a lone surrogate (an unpaired \\ud800-\\udfff escape), which is "
            "not text"
        ) from None
    return value


def join_args(body: dict) -> tuple[str, int, int, int, str, str]:
    """/init_weights_update_group's master_address, master_port, rank_offset, world_size,
    group_name and backend, each checked before any connection is tried: a master address
    that is no host (``999.1.1.1``), a port outside 1-65535, a rank outside the group or a
    backend the engine cannot join would otherwise wait out the join timeout, or fail in
    torch with a 500."""
    address = _text(field(body, "master_address", str), "master_address")
    port = field(body, "master_port", int)
    rank_offset, world_size = field(body, "rank_offset", int), field(body, "world_size", int)
    name = _text(field(body, "group_name", str, "weight_update_group"), "group_name")
    backend = field(body, "backend", str, "gloo")
    if not _is_host(address):
        raise BadRequest(f"master_address {address!r:.80} is not an IP address or a host name")
    if not 1 <= port <= 65535:
        raise BadRequest(f"master_port must be in 1-65535, got {port}")
    if not 2 <= world_size <= MAX_GROUP_WORLD_SIZE:
        raise BadRequest(f"world_size must be in 2-{MAX_GROUP_WORLD_SIZE}, got {world_size}")
    if not 1 <= rank_offset < world_size:  # rank 0 is the learner's, which hosts the group
        raise BadRequest(f"rank_offset must be in 1-{world_size - 1}, got {rank_offset}")
    if backend not in JOIN_BACKENDS:
        raise BadRequest(f"backend {backend!r:.40}: the CPU engine joins {JOIN_BACKENDS} only")
    if not name or len(name) > MAX_VERSION_CHARS:
        raise BadRequest(f"group_name must have 1-{MAX_VERSION_CHARS} characters")
    return address, port, rank_offset, world_size, name, backend


def _is_host(address: str) -> bool:
    try:
        ipaddress.ip_address(address.strip("[]"))
        return True
    except ValueError:
        numeric = address.replace(".", "").isdigit()  # dotted digits that are no IPv4
        return not numeric and HOST_NAME.match(address) is not None


def _check_names(body: dict, known: tuple, ignored: dict, default_only: dict, what: str) -> None:
    for name, value in body.items():
        if value is None or name in known:
            continue
        if name in ignored:
            field(body, name, ignored[name])
        elif name in default_only:
            default = default_only[name]
            same = value is default if isinstance(default, bool) else _is_number(value)
            if not same or value != default:
                raise BadRequest(
                    f"{what} {name!r}={value!r:.80} is not supported by the CPU engine (only "
                    f"SGLang's default {default!r})"
                )
        else:
            raise BadRequest(
                f"{what} {name!r} is not supported by the CPU engine (it implements "
                f"{', '.join(known)})"
            )


def parse_sampling(params: object, where: str = "sampling_params") -> Sampling:
    if params is None:
        return Sampling()
    if not isinstance(params, dict):
        raise BadRequest(f"{where} must be an object, got {type(params).__name__}")
    implemented = tuple(Sampling.__dataclass_fields__)
    try:
        _check_names(params, implemented, SAMPLING_IGNORED, SAMPLING_DEFAULT_ONLY, "sampling field")
        defaults = Sampling()
        sampling = Sampling(
            temperature=field(params, "temperature", float, defaults.temperature),
            top_p=field(params, "top_p", float, defaults.top_p),
            top_k=field(params, "top_k", int, defaults.top_k),
            # an explicit null means "up to the context length", as in SGLang
            max_new_tokens=field(params, "max_new_tokens", int, None)
            if "max_new_tokens" in params
            else defaults.max_new_tokens,
            stop_token_ids=_stop_token_ids(field(params, "stop_token_ids", list, [])),
            ignore_eos=field(params, "ignore_eos", bool, defaults.ignore_eos),
            sampling_seed=field(params, "sampling_seed", int, None),
        )
        _check_sampling(sampling)
    except BadRequest as error:
        raise BadRequest(f"{where}: {error}") from error
    return sampling


def _check_sampling(s: Sampling) -> None:
    """SGLang's SamplingParams.verify rules."""
    if s.temperature < 0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {s.temperature}")
    if not 0 < s.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {s.top_p}")
    if s.top_k != -1 and s.top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {s.top_k}")
    if s.max_new_tokens is not None and s.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {s.max_new_tokens}")
    low, high = SAMPLING_SEED_RANGE
    if s.sampling_seed is not None and not low <= s.sampling_seed <= high:
        raise BadRequest(f"sampling_seed must be in [-2**63, 2**63 - 1], got {s.sampling_seed}")


def _stop_token_ids(value: list) -> list[int]:
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"stop_token_ids has {len(value)} ids, past {MAX_STOP_TOKEN_IDS}")
    return _token_ids(value, "stop_token_ids")


def _token_ids(value: list, where: str, limits: PromptLimits | None = None) -> list[int]:
    """`value` checked to be token ids; a prompt (`limits` given) also shorter than the
    context, before a single id is looked at."""
    if limits is not None and len(value) >= limits.context_length:
        raise BadRequest(prompt_too_long(len(value), limits.context_length))
    for i, token in enumerate(value):
        if not is_int(token):
            raise BadRequest(f"{where}[{i}] must be an int token id, got {token!r:.80}")
    return value


def parse_generate(body: dict, limits: PromptLimits) -> tuple[list[GenerateJob], bool]:
    """The jobs of a /generate body (one per prompt) and whether it was a batch."""
    _check_names(body, GENERATE_FIELDS, GENERATE_IGNORED, GENERATE_DEFAULT_ONLY, "field")
    prompts, batched = _prompts(body, limits)
    count = len(prompts)
    params = body.get("sampling_params")
    if isinstance(params, list):
        if not batched or len(params) != count:
            what = f"a batch of {count}" if batched else "a single prompt"
            raise BadRequest(f"sampling_params is a list of {len(params)} for {what}")
        samplings = [parse_sampling(p, f"sampling_params[{i}]") for i, p in enumerate(params)]
    else:
        samplings = [parse_sampling(params)] * count
    rids = _rids(body.get("rid"), count, batched)
    routing, top = _routed_experts_start(body), _top_logprobs_num(body)
    jobs = [GenerateJob(*job, routing, top) for job in zip(prompts, samplings, rids, strict=True)]
    _check_budget(jobs, limits)
    return jobs, batched


def most_output_tokens(job: GenerateJob, context_length: int) -> int:
    """The most tokens `job` may generate: its max_new_tokens (null: up to the context), at
    most what the context leaves after the prompt (a text prompt has at least one token);
    a request asking for more is refused by the engine with SGLang's message."""
    prompt_tokens = len(job.prompt) if isinstance(job.prompt, list) else 1
    room = max(context_length - prompt_tokens, 0)
    asked = job.sampling.max_new_tokens
    return room if asked is None else min(asked, room)


def request_logprobs(jobs: list[GenerateJob], context_length: int) -> tuple[int, int]:
    """(the most output tokens of all `jobs`, the log-probs their answers may carry): each
    output token carries its own log-prob and its top_logprobs_num top ones."""
    tokens = [most_output_tokens(job, context_length) for job in jobs]
    logprobs = sum(
        count * (1 + job.top_logprobs_num) for count, job in zip(tokens, jobs, strict=True)
    )
    return sum(tokens), logprobs


def _check_budget(jobs: list[GenerateJob], limits: PromptLimits) -> None:
    """Refuse at admission a request whose answer may carry more log-probs than the server's
    budget: it would hold generation threads and memory for longer than any client waits
    (1024 prompts x 4000 tokens x top-128 is 528 million log-probs, a 13 GB answer)."""
    tokens, logprobs = request_logprobs(jobs, limits.context_length)
    if logprobs > limits.max_request_logprobs:
        top = jobs[0].top_logprobs_num
        raise BadRequest(
            f"this request may generate {tokens} tokens ({len(jobs)} prompts) carrying "
            f"{logprobs} log-probs (1 + top_logprobs_num {top} per token), past the server's "
            f"budget of {limits.max_request_logprobs} per request: send fewer prompts, a "
            "smaller max_new_tokens or top_logprobs_num, or start the server with a larger "
            "--max-request-logprobs"
        )


def _top_logprobs_num(body: dict) -> int:
    """top_logprobs_num in [0, TOP_LOGPROBS_LIMIT]; the vocabulary bounds it too (the engine's
    to check)."""
    count = field(body, "top_logprobs_num", int, 0)
    if not 0 <= count <= TOP_LOGPROBS_LIMIT:
        raise BadRequest(f"top_logprobs_num must be in [0, {TOP_LOGPROBS_LIMIT}], got {count}")
    return count


def _routed_experts_start(body: dict) -> int | None:
    """routed_experts_start_len when return_routed_experts is set (SGLang ignores the start
    otherwise); its upper bound, the prompt's length, is the engine's to check."""
    start = field(body, "routed_experts_start_len", int, 0)
    if start < 0:
        raise BadRequest(f"routed_experts_start_len must be >= 0, got {start}")
    return start if field(body, "return_routed_experts", bool, False) else None


def _prompts(body: dict, limits: PromptLimits) -> tuple[list[list[int] | str], bool]:
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise BadRequest("send exactly one of input_ids or text")
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        _check_count(len(texts), limits)
        for i, prompt in enumerate(texts):
            where = f"text[{i}]" if batched else "text"
            _check_text_length(prompt, limits, where)
            _text(prompt, where)
        prompts: list[list[int] | str] = list(texts)
        return prompts, batched
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or of such lists)")
    if not isinstance(ids[0], list):
        return [_token_ids(ids, "input_ids", limits)], False
    _check_count(len(ids), limits)
    prompts = []
    for i, prompt in enumerate(ids):
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest(f"input_ids[{i}] must be a non-empty list of token ids")
        prompts.append(_token_ids(prompt, f"input_ids[{i}]", limits))
    return prompts, True


def _check_count(count: int, limits: PromptLimits) -> None:
    if count > limits.max_prompts:
        raise BadRequest(
            f"a batch of {count} prompts: this server takes at most {limits.max_prompts} per "
            "request (--max-batch-prompts)"
        )


def _check_text_length(text: str, limits: PromptLimits, where: str) -> None:
    if len(text) > limits.max_text_chars:
        raise BadRequest(
            f"{where} has {len(text)} characters: no tokenisation of it fits the model's "
            f"context length ({limits.context_length} tokens; at most {limits.max_text_chars} "
            "characters are tokenised)"
        )


def _rids(rid: object, count: int, batched: bool) -> list[str]:
    """SGLang's rules: none -> fresh ids; a str for a batch -> "<rid>_<i>"; a list -> one
    unique id per prompt."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    if not batched or not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise BadRequest("rid must be a string, or a list of strings for a batch")
    if len(rid) != count or len(set(rid)) != count:
        raise BadRequest(f"rid must hold {count} distinct ids, got {rid!r:.200}")
    return list(rid)


def bucket_metadata(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """names, dtypes and shapes of an /update_weights_from_distributed bucket."""
    names, dtypes = field(body, "names", list), field(body, "dtypes", list)
    shapes = field(body, "shapes", list)
    if not len(names) == len(dtypes) == len(shapes):
        raise BadRequest("names, dtypes and shapes must have the same length")
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        if not isinstance(name, str):
            raise BadRequest(f"names[{i}] must be a string, got {name!r:.80}")
        if dtype not in DTYPES:
            raise BadRequest(f"dtypes[{i}] must be one of {sorted(DTYPES)}, got {dtype!r:.80}")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise BadRequest(f"shapes[{i}] must be a list of sizes >= 0, got {shape!r:.80}")
    return names, dtypes, shapes


def sglang_base_request(body: dict) -> None:
    """The fields every SGLang control request has (srt/managers/io_struct.py: BaseReq, rid
    and http_worker_ipc, strings or null), checked as SGLang checks them; any other name is
    ignored, as SGLang ignores it (srt/utils/msgspec_utils.py,
    msgspec_struct_pydantic_core_schema: extra_behavior="ignore")."""
    field(body, "rid", str, None)
    field(body, "http_worker_ipc", str, None)


def bool_flags(body: dict, *names: str) -> None:
    for name in names:
        field(body, name, bool, False)


def version_spans(output: Output) -> list[dict]:
    """SGLang's meta_info.weight_versions: runs of equal versions over the output tokens,
    tiling [0, n); one empty span of the current version when there is no token."""
    versions = output.token_versions
    if versions is None:
        versions = [output.weight_version] * len(output.output_ids)
    spans: list[dict] = []
    for i, version in enumerate(versions):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans or [{"version": output.weight_version, "start": 0, "end": 0}]


def generate_response(
    output: Output, rid: str, tokenizer: PreTrainedTokenizerBase | None, as_json: bool = False
) -> dict:
    """SGLang's /generate answer for one finished request; `as_json`: its per-token log-prob
    lists as JsonText (answer_json)."""
    if output.waiting_abort:
        return waiting_abort_response(output, rid)
    spans = version_spans(output)
    meta = {
        "id": rid,
        "finish_reason": output.finish_reason,
        "prompt_tokens": output.prompt_tokens,
        "completion_tokens": len(output.output_ids),
        "input_token_logprobs": [],  # logprob_start_len -1: no prompt position
        "output_token_logprobs": (
            JsonText(f"[{_entries_json(output.logprobs, output.output_ids)}]")
            if as_json
            else logprob_entries(output.logprobs, output.output_ids)
        ),
        "output_token_logprobs_length": len(output.output_ids),
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
        "e2e_latency": output.e2e_latency,
    }
    if output.routed_experts is not None:
        experts = output.routed_experts.numpy().astype("<i4", copy=False)
        meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode("ascii")
    meta.update(top_logprobs_meta(output, as_json))
    if tokenizer is None:  # SGLang's --skip-tokenizer-init answer: no text
        return {"output_ids": output.output_ids, "meta_info": meta}
    text = tokenizer.decode(output.output_ids)
    return {"text": text, "output_ids": output.output_ids, "meta_info": meta}


def logprob_entries(values: list[float], ids: list[int]) -> list[list]:
    """SGLang's log-prob entries: [log-prob, token id, null] (no text asked)."""
    return [[value, token, None] for value, token in zip(values, ids, strict=True)]


def top_logprobs_meta(output: Output, as_json: bool = False) -> dict:
    """SGLang's input_top_logprobs and output_top_logprobs of an answer (module doc); nothing
    when they were not asked for."""
    if output.top_logprobs is None:
        return {}
    if as_json:
        rows = ", ".join([f"[{_entries_json(*top)}]" for top in output.top_logprobs])
        return {"input_top_logprobs": [], "output_top_logprobs": JsonText(f"[{rows}]")}
    entries = [logprob_entries(values, ids) for values, ids in output.top_logprobs]
    return {"input_top_logprobs": [], "output_top_logprobs": entries}


def waiting_abort_response(output: Output, rid: str) -> dict:
    """SGLang's answer to a request aborted in its waiting queue, as
    TokenizerManager._handle_abort_req builds it for a request with return_logprob (the CPU
    engine always returns log-probs): no token, no prompt_tokens, no routed experts."""
    spans = version_spans(output)
    meta = {
        "id": rid,
        "finish_reason": output.finish_reason,
        "weight_version": spans[-1]["version"],
        "e2e_latency": output.e2e_latency,
        "weight_versions": spans,
        "input_token_logprobs": [],
        "output_token_logprobs": [],
        "output_token_logprobs_length": 0,
        **top_logprobs_meta(output),
        "completion_tokens": 0,
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


class JsonText(str):
    """Text that is JSON already: answer_json writes it as it is."""


def _entries_json(values: list[float], ids: list[int]) -> str:
    """The JSON of logprob_entries(values, ids), without the list brackets, written entry by
    entry: no list per entry is made (millions of them would run the garbage collector over
    the whole heap, holding every thread), and no single call holds the interpreter for long.
    A float is written as json.dumps writes it (repr, or NaN / Infinity)."""
    text = ", ".join(
        [f"[{value!r}, {token}, null]" for value, token in zip(values, ids, strict=True)]
    )
    if "inf" in text or "nan" in text:  # repr's spelling of a non-finite float: JSON's instead
        return json.dumps(logprob_entries(values, ids))[1:-1]
    return text


def answer_json(answer: dict | list[dict]) -> bytes:
    """The JSON of a /generate answer (as json.dumps writes it) built with
    generate_response(as_json=True): its per-token lists are JsonText already, written in
    Python an entry at a time, where json.dumps would hold the interpreter (and /health, on
    the event loop's thread) for the whole list (1.4 s for 2 million entries). Call it on a
    worker thread."""
    out: list[str] = []
    _encode(answer, out)
    return "".join(out).encode("utf-8")


def _encode(value: object, out: list[str]) -> None:
    if isinstance(value, JsonText):
        out.append(value)
    elif isinstance(value, dict):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            out.append(f"{', ' if i else ''}{json.dumps(key)}: ")
            _encode(item, out)
        out.append("}")
    elif isinstance(value, list) and value and isinstance(value[0], dict):  # a batch, spans
        out.append("[")
        for i, item in enumerate(value):
            out.append(", " if i else "")
            _encode(item, out)
        out.append("]")
    else:
        out.append(json.dumps(value))


SESSION_SELECTORS = ("target", "draft", "all")


def check_session_selector(body: dict[str, object]) -> None:
    """Refuse a session call's `selector` outside SGLang's Literal (io_struct.py's
    BeginWeightUpdateReqInput and EndWeightUpdateReqInput: target, draft or all; "all" when
    absent). The engine has no draft model: every selector means its one model."""
    selector = field(body, "selector", str, "all")
    if selector not in SESSION_SELECTORS:
        raise BadRequest(
            f"selector must be one of {', '.join(SESSION_SELECTORS)}, got {selector!r}"
        )
