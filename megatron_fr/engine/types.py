"""The types every inference engine speaks, whatever serves it: the sampling parameters of a
request, the validated answer of a generation (its tokens, their log-probs and the versions of
the weights that produced them), the error a malformed answer raises, the pause modes of a
weight sync and the layout of routed experts. Each engine's wire (engine/sglang/protocol.py,
engine/vllm/wire.py, the CPU engine) reads its own format into these; everything past the wire
(rollout, weights, orchestrator) takes them from here, never from an engine's own module.

They follow SGLang's semantics where the engines differ (its sampling parameters, its finish
reasons and pause modes), since SGLang's wire was the first the project spoke.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, field_validator

from megatron_fr.engine.top_logprobs import TopLogProbs

if TYPE_CHECKING:
    import torch

HEALTH_PATH = "/health"
"""GET: answers once the server is up (SGLang, vLLM and the CPU engine alike)."""

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

TensorSerializer = Callable[[list[tuple[str, "torch.Tensor"]]], str]
"""Named tensors to the text of one payload of the tensor transport (engine/wire.py:
tensor_request)."""

# SGLang samples greedily (top_k = 1) below this temperature (sampling_params._SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-6


class SamplingParams(BaseModel):
    """The sampling parameters the project uses; `to_json()` is SGLang's `sampling_params`."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature. SGLang treats values below 1e-6 as greedy decoding."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass; 1.0 keeps the whole distribution."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 disables (SGLang refuses 0 and other negatives)."""
    max_new_tokens: PositiveInt
    """Most tokens to generate for this request (a continuation counts what came before)."""
    stop_token_ids: tuple[NonNegativeInt, ...] = ()
    """Token ids that end generation (in addition to the model's EOS)."""
    sampling_seed: int | None = Field(default=None, ge=0, lt=2**63)
    """Seeds the request's sampler: the same seed, weights and prompt give the same tokens
    (the CPU engine always; SGLang under --enable-deterministic-inference). None: unseeded."""

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {value}")
        return value

    def to_json(self) -> dict[str, object]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_new_tokens,
            "stop_token_ids": list(self.stop_token_ids),
            **({} if self.sampling_seed is None else {"sampling_seed": self.sampling_seed}),
        }

    def logprob_mismatch(self) -> str | None:
        """Why the log-probs SGLang reports are not those of the distribution it sampled from, or
        None when they are. SGLang returns log_softmax(logits / temperature) computed BEFORE
        top-p/top-k truncation (srt/layers/sampler.py), and for greedy decoding the log-softmax
        of the raw logits; an importance ratio built on them would be wrong."""
        if self.temperature < GREEDY_TEMPERATURE:
            return f"temperature={self.temperature} is greedy decoding (SGLang sets top_k=1)"
        if self.top_p < 1.0:
            return f"top_p={self.top_p} < 1 truncates the sampling distribution"
        if self.top_k > 0:
            return f"top_k={self.top_k} truncates the sampling distribution"
        return None


class RoutedExpertsLayout(BaseModel):
    """What each position of SGLang's `meta_info.routed_experts` holds: the ids of the top_k
    experts of each of num_layers layers. SGLang sends them as base64 of a C-order int32 array
    [positions, num_layers, top_k] (srt/managers/detokenizer_manager.py:
    _b64_encode_per_request; srt/state_capturer/routed_experts.py reads it back with
    np.frombuffer(..., dtype=np.int32)), with num_layers = the config's num_hidden_layers and
    top_k = num_experts_per_tok; the ids are logical experts, captured before any expert-
    parallel remapping (srt/layers/moe/topk.py: capture_routed_experts_if_allowed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: PositiveInt
    """The model's num_hidden_layers (SGLang reports every layer)."""
    top_k: PositiveInt
    """num_experts_per_tok."""
    num_experts: PositiveInt
    """Routed experts per layer: every id must be below it."""


class MalformedResponse(ValueError):
    """A /generate response that breaks SGLang's contract. `path` names the offending field."""

    def __init__(self, path: str, problem: str, server: str | None = None) -> None:
        self.path = path
        self.problem = problem
        self.server = server
        origin = f" from {server}" if server else ""
        super().__init__(f"malformed /generate response{origin}: {path}: {problem}")

    def from_server(self, server: str) -> MalformedResponse:
        """The same error, saying which server sent the response."""
        return MalformedResponse(self.path, self.problem, server)


@dataclass(frozen=True)
class GenerateOutput:
    """One finished /generate response, validated."""

    output_ids: list[int]
    output_logprobs: list[float]
    """Behavior log-prob of each output token, as SGLang computed it when sampling."""
    finish_reason: FinishReason
    weight_version: str
    """SGLang's `meta_info.weight_version`: the version of the last output token's weights (the
    server's version when there is no token)."""
    token_versions: list[str]
    """The version of the weights that produced each output token, from SGLang's
    `meta_info.weight_versions` spans."""
    routed_experts: object | None
    """SGLang's routed-experts payload as received (base64 text; decode_routed_experts reads
    it, knowing the rows asked for); None when the server sent none."""
    prompt_tokens: int | None
    top_logprobs: TopLogProbs | None = None
    """The top-K ids and log-probs of each output token's distribution from token
    `top_logprobs_from` on (one row per token), when they were asked for (top_logprobs_num >
    0); None otherwise."""
    top_logprobs_from: int = 0
    """How many leading output tokens came without their top-K (SGLang's null rows)."""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_version_spans(meta: dict, count: int, version: str, prefix: str) -> list[str]:
    """One version per output token from SGLang's `meta_info.weight_versions`
    (srt/utils/weight_versions.py: add_weight_versions_to_meta_info): [{version, start, end}]
    spans, non-empty and in order, tiling [0, len(output_ids)); a response without a token has
    one span [0, 0), or none (some of SGLang's abort paths). `weight_version` is the last span's
    version. A response with tokens but no spans is refused: tagging every token with the final
    version would understate the lag of the tokens sampled before an update."""
    path = _join(prefix, "weight_versions")
    spans = meta.get("weight_versions")
    if spans is None and count == 0:
        return []
    if not isinstance(spans, list) or not spans:
        got = "missing" if spans is None else repr(spans)[:80]
        raise MalformedResponse(path, f"expected a non-empty list of spans, got {got}")
    versions: list[str] = []
    for i, span in enumerate(spans):
        where = f"{path}[{i}]"
        if not isinstance(span, dict) or set(span) != {"version", "start", "end"}:
            raise MalformedResponse(where, f"expected {{version, start, end}}, got {span!r:.80}")
        start, end, name = span["start"], span["end"], span["version"]
        if not isinstance(name, str):
            raise MalformedResponse(f"{where}.version", f"expected a string, got {name!r}")
        if not _is_int(start) or start != len(versions):
            raise MalformedResponse(f"{where}.start", f"expected {len(versions)}, got {start!r}")
        empty_ok = count == 0 and len(spans) == 1
        if not _is_int(end) or not (start <= end if empty_ok else start < end) or end > count:
            raise MalformedResponse(
                f"{where}.end", f"expected {start + (not empty_ok)}..{count}, got {end!r}"
            )
        versions.extend([name] * (end - start))
    if len(versions) != count:
        raise MalformedResponse(path, f"cover {len(versions)} of {count} output tokens")
    if spans[-1]["version"] != version:
        raise MalformedResponse(
            _join(prefix, "weight_version"),
            f"{version!r} is not the last span's version {spans[-1]['version']!r}",
        )
    return versions
