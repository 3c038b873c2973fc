"""The CPU inference engine behind ``cpu_server``: a transformers model, sampling, weight updates.

Requests run one thread each; their decoding steps interleave, each step under ``_step_lock``.
What the engine guarantees, and why:

- Log-probs: the log-prob reported for a token is that of the distribution the token was
  drawn from (logits / temperature, then top-k, then top-p), so an importance ratio built on
  it is exact (SGLang reports the untruncated one; protocol.SamplingParams.logprob_mismatch).
- Per-token weight versions: a step reads the version label inside the same critical section
  that runs the model, and every change of weights or label takes that lock, so the version
  recorded for a token is the version of the weights that produced it, whatever the pause
  mode and however an update races with the request.
- Atomic weight updates. A distributed update spans several HTTP calls (/begin_weight_update,
  one /update_weights_from_distributed per bucket, /end_weight_update) and its sender can
  die between them, so its tensors are staged and swapped in at /end_weight_update in one
  step-lock section (with the version it named): generation keeps running on the complete old
  weights meanwhile, a rejected bucket discards the whole update, and a session that never
  ends changes nothing. Memory: one copy of what the session sent. A disk load is one call, so
  it holds the step lock across all its chunks instead (no steps run during it; memory stays
  one chunk); names and shapes are checked against the model before anything is written, and
  should reading still fail half-way, the engine refuses to decode (WeightsFault, HTTP 503)
  until a later update completes, rather than serve a mix of two versions.
- Pauses work as in SGLang: "abort" ends the requests present (finish reason "abort", tokens so
  far returned); "in_place" holds them between steps with their KV cache, so after an update
  they continue on the new weights over a prefix encoded by the old ones; "retract" holds them
  too but drops their KV cache, so they resume by re-encoding prompt and tokens so far with
  the new weights. Requests arriving while paused wait for /continue_generation.
"""

from __future__ import annotations

import inspect
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_fr.convert.hf_files import HFCheckpointReader
from megatron_fr.engine.protocol import GREEDY_TEMPERATURE

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")

DISK_CHUNK_TENSORS = 64
"""Tensors read from disk at a time by a disk load (bounded memory on big checkpoints)."""

PAUSE_MODES = ("abort", "retract", "in_place")


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


class Aborted(Exception):
    """A request ended by /abort_request, a disconnected client or /pause_generation abort."""


class RequestError(ValueError):
    """A request the model cannot take (token outside the vocabulary, longer than the context,
    a rid already running); answered with HTTP 400 before any work."""


class WeightsFault(RuntimeError):
    """The weights were left half-written by a failed load; decoding is refused until a later
    update completes (HTTP 503: the client retries on another server)."""


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


@dataclass
class _UpdateSession:
    """Tensors staged between /begin_weight_update and /end_weight_update."""

    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    version: str | None = None
    failure: str | None = None


class CpuEngine:
    """One transformers model serving many concurrent requests, step by step."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: torch.dtype = torch.float32,
        context_length: int | None = None,
    ):
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.tokenizer = _optional_tokenizer(model_path)
        self.context_length = context_length or _config_context_length(self.model.config)
        self.weight_version = "default"
        self._step_lock = threading.Lock()
        self._state = threading.Condition()
        self._paused: str | None = None
        self._retractions = 0
        self._active: set[str] = set()
        self._aborted: set[str] = set()
        self._session: _UpdateSession | None = None
        self.fault: str | None = None
        """Why the weights are unusable (a load failed half-way), or None."""
        self._eos = set(_as_list(self.model.generation_config.eos_token_id))
        self._cache_arg = _cache_argument(self.model)

    # --- generation ---------------------------------------------------------------------

    def generate(self, input_ids: list[int], sampling: Sampling, rid: str) -> Output:
        """Decode one request to a stop token, its token budget, or an abort."""
        budget = self._token_budget(input_ids, sampling)
        generator = torch.Generator()
        seed = sampling.sampling_seed
        generator.manual_seed(seed if seed is not None else _fresh_seed())
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[str] = []
        finish: dict = {"type": "length", "length": budget}
        self._enter(rid)
        try:
            cache, feed, retractions = None, list(input_ids), self._wait_while_paused(rid)
            for _ in range(budget):
                seen = self._wait_while_paused(rid)
                if seen != retractions:  # retracted while paused: re-encode with new weights
                    cache, feed, retractions = None, list(input_ids) + ids, seen
                with self._step_lock, torch.no_grad():
                    if self.fault is not None:
                        raise WeightsFault(self.fault)
                    result = self.model(
                        input_ids=torch.tensor([feed]), use_cache=True, **{self._cache_arg: cache}
                    )
                    versions.append(self.weight_version)
                cache = getattr(result, self._cache_arg)
                log_probs = sampling_log_probs(result.logits[0, -1], sampling)
                token = _pick(log_probs, sampling, generator)
                ids.append(token)
                logprobs.append(log_probs[token].item())
                feed = [token]
                if token in sampling.stop_token_ids or (
                    token in self._eos and not sampling.ignore_eos
                ):
                    finish = {"type": "stop", "matched": token}
                    break
        except Aborted:
            finish = {"type": "abort", "message": "aborted"}
        finally:
            self._leave(rid)
        return Output(ids, logprobs, finish, self.weight_version, len(input_ids), versions)

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
            raise RequestError(
                f"The input ({count} tokens) is longer than the model's context length "
                f"({limit} tokens)."
            )
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

    def _leave(self, rid: str) -> None:
        with self._state:
            self._active.discard(rid)
            self._aborted.discard(rid)
            self._state.notify_all()

    def _wait_while_paused(self, rid: str) -> int:
        """Block while paused; raise Aborted if `rid` was aborted; the retraction count."""
        with self._state:
            self._state.wait_for(lambda: self._paused is None or rid in self._aborted)
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
                self._aborted |= self._active
            if mode == "retract":
                self._retractions += 1
            self._state.notify_all()

    def resume(self) -> None:
        with self._state:
            self._paused = None
            self._state.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        with self._state:
            targets = set(self._active) if abort_all else {rid} & self._active
            self._aborted |= targets
            self._state.notify_all()
            return len(targets)

    @property
    def active_requests(self) -> int:
        with self._state:
            return len(self._active)

    # --- weights ------------------------------------------------------------------------

    def set_weight_version(self, version: str) -> None:
        """Relabel the served weights; inside an update session the label waits for the
        staged weights it names (applied at end_update)."""
        with self._state:
            if self._session is not None:
                self._session.version = version
                return
        with self._step_lock:
            self.weight_version = version

    @property
    def update_session_open(self) -> bool:
        with self._state:
            return self._session is not None

    def begin_update(self) -> None:
        with self._state:
            if self._session is not None:
                raise RequestError(
                    "a weight-update session is already open; call end_weight_update"
                )
            self._session = _UpdateSession()

    def check_update(self, shapes: list[tuple[str, list[int]]]) -> None:
        """Refuse, before a byte is received, a bucket whose names or shapes the model does not
        have, or one sent outside a session (the caller marks the session failed)."""
        if not self.update_session_open:
            raise RequestError(
                "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()"
            )
        params = dict(self.model.named_parameters())
        try:
            for name, shape in shapes:
                _target_slice(params, name, shape)
        except (KeyError, ValueError) as error:
            raise RequestError(_message(error)) from error

    def fail_update(self, reason: str) -> None:
        """Mark the open session (if any) as failed: its end applies nothing."""
        with self._state:
            if self._session is not None and self._session.failure is None:
                self._session.failure = reason

    def stage(self, tensors: list[tuple[str, torch.Tensor]], version: str | None) -> int:
        """Keep one received bucket (and the version it names) for end_update."""
        self.check_update([(name, list(tensor.shape)) for name, tensor in tensors])
        with self._state:
            if self._session is None:
                raise RequestError("the weight-update session ended while a bucket arrived")
            self._session.tensors += tensors
            if version is not None:
                self._session.version = version
        return len(tensors)

    def end_update(self) -> int:
        """Swap every staged tensor (and the session's version) in at once; raise, changing
        nothing, if a bucket of the session was refused."""
        with self._state:
            session, self._session = self._session, None
        if session is None:
            raise RequestError("no weight-update session is open; call begin_weight_update first")
        if session.failure is not None:
            raise RequestError(f"weight update discarded, nothing applied: {session.failure}")
        params = dict(self.model.named_parameters())
        with self._step_lock, torch.no_grad():
            for name, tensor in session.tensors:
                _target_slice(params, name, tensor.shape).copy_(tensor)
            if session.version is not None:
                self.weight_version = session.version
            self.fault = None
        return len(session.tensors)

    def load_from_disk(self, model_path: str | Path, version: str | None = None) -> int:
        """Load every tensor of an HF checkpoint directory (and then the version label) with
        no decoding step in between."""
        params = dict(self.model.named_parameters())
        try:  # everything checked before anything is written
            reader = HFCheckpointReader(model_path)
            names = sorted(reader.tensors)
            for name in names:
                _target_slice(params, name, reader.tensors[name].shape)
        except Exception as error:  # a missing directory, a foreign checkpoint, a bad header
            raise RequestError(f"model_path {str(model_path)!r}: {_message(error)}") from error
        with self._step_lock, torch.no_grad():
            try:
                for start in range(0, len(names), DISK_CHUNK_TENSORS):
                    chunk = reader.read(names[start : start + DISK_CHUNK_TENSORS])
                    for name, tensor in chunk.items():
                        _target_slice(params, name, tensor.shape).copy_(tensor)
            except Exception as error:
                self.fault = f"loading {model_path} failed half-way ({error}); update again"
                raise WeightsFault(self.fault) from error
            if version is not None:
                self.weight_version = version
            self.fault = None
        return len(names)

    def read_named_tensor(self, name: str) -> torch.Tensor:
        with self._step_lock:
            params = dict(self.model.named_parameters())
            return _target_slice(params, name, None).detach().clone()


def _target_slice(params: dict, name: str, shape: torch.Size | None) -> torch.Tensor:
    """The live tensor a checkpoint-named tensor (save_pretrained names) is written into.

    transformers keeps a MoE layer's experts fused in memory (experts.gate_up_proj [E, 2I, H]
    with gate first, experts.down_proj [E, H, I]); per-expert names map to their slices.
    Unknown names and wrong shapes raise, naming the tensor."""
    target = params.get(name)
    match = _EXPERT.match(name)
    if match:
        prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
        fused = params.get(f"{prefix}.{'down_proj' if which == 'down' else 'gate_up_proj'}")
        if fused is not None and expert < fused.shape[0]:
            target = fused[expert]
            if which != "down":
                half = target.shape[0] // 2
                target = target[:half] if which == "gate" else target[half:]
    if target is None:
        raise KeyError(f"{name}: no such tensor in the served model")
    if shape is not None and tuple(target.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {list(shape)} sent, the model has {list(target.shape)}")
    return target


def _message(error: Exception) -> str:
    return str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)


def _pick(log_probs: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature < GREEDY_TEMPERATURE:
        return int(torch.argmax(log_probs))
    return int(torch.multinomial(log_probs.exp(), 1, generator=generator))


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _cache_argument(model: torch.nn.Module) -> str:
    """The name transformers gives the KV cache, in the forward's arguments and its output:
    "cache" from transformers 5 on ("past_key_values" is deprecated there), before that
    "past_key_values"."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _config_context_length(config) -> int:
    length = getattr(config, "max_position_embeddings", None)
    if not isinstance(length, int) or length < 2:
        raise ValueError(
            f"config.json has no usable max_position_embeddings ({length!r}): pass --context-length"
        )
    return length


def _optional_tokenizer(model_path: str | Path):
    """The tokenizer if the directory has one; None serves input_ids-only requests (like
    SGLang's --skip-tokenizer-init)."""
    path = Path(model_path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
