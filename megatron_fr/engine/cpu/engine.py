"""The CPU inference engine behind ``cpu_server``: a transformers model, sampling, pauses.

Requests run one thread each; their decoding steps interleave, each inside
`ServedWeights.step()` (cpu_weights), which also gives the version of the weights the step
runs on, so every output token carries the version of the weights that produced it, whatever
the pause mode and however an update races with the request. What else the engine guarantees:

- Log-probs: the log-prob reported for a token is that of the distribution the token was
  drawn from (logits / temperature, then top-k, then top-p), so an importance ratio built on
  it is exact (SGLang reports the untruncated one; protocol.SamplingParams.logprob_mismatch).
- Limits: a prompt outside the vocabulary or the context length (config max_position_embeddings
  or the --context-length flag, as in SGLang) is refused before any work.
- Pauses work as in SGLang: "abort" ends the requests present (finish reason "abort", tokens so
  far returned); "in_place" holds them between steps with their KV cache, so after an update
  they continue on the new weights over a prefix encoded by the old ones; "retract" holds them
  too but drops their KV cache, so they resume by re-encoding prompt and tokens so far with
  the new weights. Requests arriving while paused wait for /continue_generation (abort_all
  and a later "abort" pause leave them waiting, as in SGLang); an aborted request (by rid,
  abort_all, or its client disconnecting) ends at its next step.
- A request aborted before its first decoding step (waiting for the step lock, as a request
  waits in SGLang's waiting queue) ends with no token and finish message "Abort in waiting
  queue", and carries no routed experts: SGLang answers those from
  TokenizerManager._handle_abort_req, which attaches none (cpu_wire answers in that shape).
- Routed experts (SGLang's return_routed_experts, MoE models), when the engine runs with
  return_routed_experts (SGLang's --enable-return-routed-experts; without it, as SGLang, a
  request asking for them gets none): forward hooks on every layer's router record the top-k
  expert ids of each position as it is fed; a request gets those of positions
  [routed_experts_start_len, prompt + output - 1), as [positions, layers, top_k] int32 like
  SGLang's (zeros for a layer without router, as in SGLang's capture buffer). A retracted
  request re-encodes its prefix, so its record restarts with the new routing.
- Top-K log-probs (SGLang's top_logprobs_num = K): for every output token, the K most likely
  tokens of the distribution it was drawn from and their log-probs, in descending order, -inf
  clamped to the float's smallest value as SGLang's logprob processor does (SGLang takes them
  before top-p/top-k truncation; training refuses truncated sampling, where the two agree).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_fr.engine.cpu.weights import RequestError, ServedWeights
from megatron_fr.engine.sglang.protocol import GREEDY_TEMPERATURE

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

PAUSE_MODES = ("abort", "retract", "in_place")
WAITING_ABORT_MESSAGE = "Abort in waiting queue"
"""SGLang's finish message for a request aborted before it was scheduled
(TokenizerManager._handle_abort_req)."""


@dataclass
class Sampling:
    """The SGLang sampling parameters the engine implements, with SGLang's defaults."""

    temperature: float = 1.0
    """Below protocol.GREEDY_TEMPERATURE: greedy decoding (as SGLang)."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 keeps the whole vocabulary."""
    max_new_tokens: int | None = 128
    """None: up to the context length."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    sampling_seed: int | None = None
    """Seeds the request's own generator (same seed, same tokens); None draws a fresh one."""


@dataclass
class Output:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    weight_version: str
    """The engine's version label when the request finished."""
    prompt_tokens: int
    token_versions: list[str] | None = None
    """The version of the weights that produced each output token; None means all of them were
    produced by `weight_version` (an engine whose weights never change mid-request)."""
    routed_experts: torch.Tensor | None = None
    """int32 [positions, layers, top_k]: the experts of the positions asked for (module doc);
    None when not asked, not enabled, or aborted while waiting."""
    waiting_abort: bool = False
    """Aborted before its first step: SGLang's waiting-queue abort (module doc)."""
    top_logprobs: list[tuple[list[float], list[int]]] | None = None
    """(log-probs, ids) of each output token's top K (module doc); None when not asked."""
    e2e_latency: float = 0.0
    """Seconds from arrival to the answer (SGLang's meta_info.e2e_latency)."""


class Aborted(Exception):
    """A request ended by /abort_request, a disconnected client or /pause_generation abort."""


def sampling_log_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from: logits / T, then top-k, then
    top-p (the smallest set of most likely tokens whose mass reaches p). Greedy decoding
    reports the plain softmax, as SGLang does."""
    logits = logits.float()
    if sampling.temperature < GREEDY_TEMPERATURE:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = order[probs.cumsum(-1) - probs >= sampling.top_p]
        logits = logits.index_fill(0, drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class RouterCapture:
    """The top-k expert ids a transformers MoE model's routers pick, per layer, during the
    forward calls the current thread runs inside `recording` (requests decode on their own
    threads). transformers' MoE routers (e.g. Qwen3MoeTopKRouter) return
    (router_logits, routing_weights, expert_indices [tokens, top_k])."""

    def __init__(self, model: PreTrainedModel):
        config = model.config
        self.num_layers = config.num_hidden_layers
        self.top_k = getattr(config, "num_experts_per_tok", 0)
        self._local = threading.local()
        self.layers: list[int] = []
        for index, layer in enumerate(getattr(getattr(model, "model", None), "layers", [])):
            gate = getattr(getattr(layer, "mlp", None), "gate", None)
            if self.top_k and isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k"):
                gate.register_forward_hook(self._hook(index))
                self.layers.append(index)

    @property
    def available(self) -> bool:
        return bool(self.layers)

    def _hook(self, layer: int) -> Callable[[torch.nn.Module, object, tuple], None]:
        def record(_module: torch.nn.Module, _args: object, output: tuple) -> None:
            picks = getattr(self._local, "picks", None)
            if picks is not None:
                picks.append((layer, output[2]))

        return record

    @contextmanager
    def recording(self, positions: int) -> Iterator[list[torch.Tensor]]:
        """Record one forward over `positions` positions; the list receives their
        [positions, layers, top_k] int32 routing when the block ends."""
        result: list[torch.Tensor] = []
        self._local.picks = []
        try:
            yield result
            routing = torch.zeros((positions, self.num_layers, self.top_k), dtype=torch.int32)
            for layer, picks in self._local.picks:
                routing[:, layer] = picks.reshape(positions, self.top_k).to(torch.int32)
            result.append(routing)
        finally:
            self._local.picks = None


class CpuEngine:
    """One transformers model serving many concurrent requests, step by step."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: torch.dtype = torch.float32,
        context_length: int | None = None,
        return_routed_experts: bool = False,
    ):
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.dtype = dtype
        self.return_routed_experts = return_routed_experts
        """SGLang's --enable-return-routed-experts (module doc)."""
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.tokenizer = _optional_tokenizer(model_path)
        if context_length is not None and context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {context_length}")
        self.context_length = context_length or _config_context_length(self.model.config)
        self.weights = ServedWeights(self.model)
        self._state = threading.Condition()
        self._paused: str | None = None
        self._retractions = 0
        self._active: set[str] = set()
        self._admitting: set[str] = set()
        """Requests that arrived while paused and wait for /continue_generation: as in SGLang
        (they wait before reaching its scheduler), abort_all and a pause "abort" skip them;
        an abort by rid (or their client leaving) still ends them."""
        self._aborted: set[str] = set()
        self._eos = set(_as_list(self.model.generation_config.eos_token_id))
        self._cache_arg = _cache_argument(self.model)
        self.routers = RouterCapture(self.model)

    # --- generation ---------------------------------------------------------------------

    def generate(
        self,
        input_ids: list[int],
        sampling: Sampling,
        rid: str,
        routed_experts_start: int | None = None,
        top_logprobs: int = 0,
    ) -> Output:
        """Decode one request to a stop token, its token budget, or an abort; with
        routed_experts_start, report the routed experts from that position on, with
        top_logprobs = K, every token's top K (module doc)."""
        arrived = time.monotonic()
        budget = self._token_budget(input_ids, sampling)
        self._check_routing_request(input_ids, routed_experts_start)
        self._check_top_logprobs(top_logprobs)
        asked = routed_experts_start is not None and self.return_routed_experts
        generator = torch.Generator()
        seed = sampling.sampling_seed
        generator.manual_seed(seed if seed is not None else _fresh_seed())
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[str] = []
        routed: list[torch.Tensor] = []
        tops: list[tuple[list[float], list[int]]] = []
        finish: dict = {"type": "length", "length": budget}
        self._enter(rid)
        try:
            cache, feed, retractions = None, list(input_ids), self._wait_while_paused(rid)
            for _ in range(budget):
                seen = self._wait_while_paused(rid)
                if seen != retractions:  # retracted while paused: re-encode with new weights
                    cache, feed, retractions = None, list(input_ids) + ids, seen
                    routed.clear()
                logits, cache, version, step = self._forward(rid, feed, cache, asked)
                routed += step
                versions.append(version)
                log_probs = sampling_log_probs(logits, sampling)
                token = _pick(log_probs, sampling, generator)
                ids.append(token)
                logprobs.append(log_probs[token].item())
                if top_logprobs:
                    tops.append(_top(log_probs, top_logprobs))
                feed = [token]
                if token in sampling.stop_token_ids or (
                    token in self._eos and not sampling.ignore_eos
                ):
                    finish = {"type": "stop", "matched": token}
                    break
        except Aborted:
            message = "aborted" if versions else WAITING_ABORT_MESSAGE
            finish = {"type": "abort", "message": message}
        finally:
            self._leave(rid)
        output = Output(ids, logprobs, finish, self.weight_version, len(input_ids), versions)
        output.waiting_abort = finish["type"] == "abort" and not versions
        output.e2e_latency = time.monotonic() - arrived
        output.top_logprobs = tops if top_logprobs else None
        if asked and not output.waiting_abort:
            fed = torch.cat(routed) if routed else self._no_routing()
            output.routed_experts = fed[routed_experts_start:]
        return output

    def _forward(
        self, rid: str, feed: list[int], cache: object, record_routing: bool
    ) -> tuple[torch.Tensor, object, str, list[torch.Tensor]]:
        """One decoding step under the weights' lock: the last position's logits, the KV cache,
        the weights' version, and the fed positions' routing when recorded. Aborted when the
        request was aborted while it waited for the lock."""
        record: AbstractContextManager[list[torch.Tensor]] = (
            self.routers.recording(len(feed)) if record_routing else nullcontext([])
        )
        with self.weights.step() as version, record as routing:
            self._raise_if_aborted(rid)
            result = self.model(
                input_ids=torch.tensor([feed]), use_cache=True, **{self._cache_arg: cache}
            )
        return result.logits[0, -1], getattr(result, self._cache_arg), version, routing

    def _check_routing_request(self, input_ids: list[int], start: int | None) -> None:
        """Refused as SGLang refuses it (start in [0, prompt length]), and on a model without
        MoE routers, which has no routed experts to report."""
        if start is None:
            return
        if self.return_routed_experts and not self.routers.available:
            raise RequestError("return_routed_experts: this model has no MoE router")
        if not 0 <= start <= len(input_ids):
            raise RequestError(
                f"routed_experts_start_len={start} must be in [0, {len(input_ids)}] (the number "
                "of input tokens)"
            )

    def _check_top_logprobs(self, count: int) -> None:
        """K in [0, the vocabulary] (SGLang's torch.topk fails beyond it)."""
        vocab = self.model.config.vocab_size
        if not 0 <= count <= vocab:
            raise RequestError(f"top_logprobs_num={count} must be in [0, {vocab}] (the vocabulary)")

    def _no_routing(self) -> torch.Tensor:
        return torch.zeros((0, self.routers.num_layers, self.routers.top_k), dtype=torch.int32)

    def _token_budget(self, input_ids: list[int], sampling: Sampling) -> int:
        """Refuse what the model cannot take, as SGLang's tokenizer manager does, before any
        work (a prompt over the context would otherwise hold the step lock for its whole
        forward); the number of tokens the request may generate."""
        if not input_ids:
            raise RequestError("input_ids is empty")
        vocab = self.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise RequestError(f"input_ids outside the vocabulary [0, {vocab})")
        count, limit = len(input_ids), self.context_length
        if count >= limit:
            raise RequestError(prompt_too_long(count, limit))
        if sampling.max_new_tokens is None:
            return limit - count
        if count + sampling.max_new_tokens > limit:
            raise RequestError(
                f"Requested token count exceeds the model's maximum context length of {limit} "
                f"tokens. You requested a total of {count + sampling.max_new_tokens} tokens: "
                f"{count} tokens from the input and {sampling.max_new_tokens} tokens for the "
                "completion."
            )
        return sampling.max_new_tokens

    def _enter(self, rid: str) -> None:
        with self._state:
            if rid in self._active:
                raise RequestError(f"rid {rid!r} is already running")
            self._active.add(rid)
            self._admitting.add(rid)

    def _leave(self, rid: str) -> None:
        with self._state:
            self._active.discard(rid)
            self._admitting.discard(rid)
            self._aborted.discard(rid)
            self._state.notify_all()

    def _raise_if_aborted(self, rid: str) -> None:
        with self._state:
            if rid in self._aborted:
                raise Aborted(rid)

    def _wait_while_paused(self, rid: str) -> int:
        """Block while paused; raise Aborted if `rid` was aborted; the retraction count."""
        with self._state:
            self._state.wait_for(lambda: self._paused is None or rid in self._aborted)
            self._admitting.discard(rid)
            if rid in self._aborted:
                raise Aborted(rid)
            return self._retractions

    # --- control ------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._state:
            self._paused = mode
            if mode == "abort":
                self._aborted |= self._active - self._admitting
            if mode == "retract":
                self._retractions += 1
            self._state.notify_all()

    def resume(self) -> None:
        with self._state:
            self._paused = None
            self._state.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        with self._state:
            targets = self._active - self._admitting if abort_all else self._active & {rid}
            self._aborted |= targets
            self._state.notify_all()
            return len(targets)

    @property
    def active_requests(self) -> int:
        with self._state:
            return len(self._active)

    @property
    def running_requests(self) -> int:
        """Requests that hold decoding state, what SGLang's /flush_cache waits for: not those
        that arrived during a pause (SGLang holds them before its scheduler), nor any under
        a retract pause (retracted requests give their cache back)."""
        with self._state:
            if self._paused == "retract":
                return 0
            return len(self._active - self._admitting)

    # --- weights ------------------------------------------------------------------------

    @property
    def weight_version(self) -> str:
        return self.weights.version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        self.weights.set_version(version)


def prompt_too_long(count: int, limit: int) -> str:
    """SGLang's refusal of a prompt that leaves no room in the context (tokenizer manager)."""
    return f"The input ({count} tokens) is longer than the model's context length ({limit} tokens)."


def _pick(log_probs: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(log_probs))
    return int(torch.multinomial(log_probs.exp(), 1, generator=generator))


def _top(log_probs: torch.Tensor, count: int) -> tuple[list[float], list[int]]:
    """The `count` largest log-probs, descending, and their ids; -inf clamped as SGLang does."""
    values, ids = torch.topk(log_probs.clamp_min(torch.finfo(log_probs.dtype).min), count)
    return values.tolist(), ids.tolist()


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)))


def _as_list(value: int | list[int] | tuple[int, ...] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _cache_argument(model: PreTrainedModel) -> str:
    """The name transformers gives the KV cache, in the forward's arguments and its output:
    "cache" in recent releases (the installed 5.25 warns that "past_key_values" will be removed
    in 5.40), "past_key_values" in older ones."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _config_context_length(config: PreTrainedConfig) -> int:
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length < 2:
        raise ValueError(
            f"config.json has no usable max_position_embeddings ({length!r}): pass --context-length"
        )
    return length


def _optional_tokenizer(model_path: str | Path) -> PreTrainedTokenizerBase | None:
    """The tokenizer if the directory has one; None serves input_ids-only requests (like
    SGLang's --skip-tokenizer-init)."""
    path = Path(model_path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
