"""The CPU inference engine behind ``cpu_server``: a transformers model, sampling, weight updates.

What it must get right for RL: the log-prob returned for each token is that of the
distribution the token was actually drawn from (temperature, top-k and top-p applied), and
the weights never change in the middle of a forward step — each decoding step runs under one
lock that a weight update also takes, so every token is produced by exactly one weight
version. Pausing works as in SGLang: mode "abort" ends in-flight requests (finish reason
"abort", tokens so far returned), "in_place"/"retract" hold them between steps; new requests
wait while paused.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_fr.convert.hf_files import HFCheckpointReader

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass
class Sampling:
    """The SGLang sampling parameters the engine implements."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    @classmethod
    def from_json(cls, body: dict) -> Sampling:
        known = {name: body[name] for name in cls.__dataclass_fields__ if name in body}
        sampling = cls(**{k: v for k, v in known.items() if v is not None})
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.max_new_tokens < 0:
            raise ValueError(f"invalid sampling_params {known}")
        return sampling


@dataclass
class Output:
    output_ids: list[int]
    logprobs: list[float]
    finish_reason: dict
    weight_version: str
    prompt_tokens: int


class Aborted(Exception):
    """A request ended by /abort_request or /pause_generation mode=abort."""


def sampling_log_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Log-probs of the distribution tokens are drawn from: logits / T, then top-k, then
    top-p (the smallest set of most likely tokens whose mass reaches p). T = 0 is greedy and
    reports the plain softmax's log-prob of the argmax."""
    logits = logits.float()
    if sampling.temperature > 0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = order[probs.cumsum(-1) - probs >= sampling.top_p]
        logits = logits.index_fill(0, drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


class CpuEngine:
    """One transformers model serving many concurrent requests, step by step."""

    def __init__(self, model_path: str | Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.tokenizer = _optional_tokenizer(model_path)
        self.weight_version = "default"
        self._step_lock = threading.Lock()
        self._state = threading.Condition()
        self._paused: str | None = None
        self._active: set[str] = set()
        self._aborted: set[str] = set()
        self._eos = set(_as_list(self.model.generation_config.eos_token_id))

    # --- generation ---------------------------------------------------------------------

    def generate(self, input_ids: list[int], sampling: Sampling, rid: str) -> Output:
        """Decode one request to a stop token, max_new_tokens, or an abort."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        vocab = self.model.config.vocab_size
        if min(input_ids) < 0 or max(input_ids) >= vocab:
            raise ValueError(f"input_ids outside the vocabulary [0, {vocab})")
        generator = torch.Generator()
        generator.manual_seed(sampling.seed if sampling.seed is not None else _fresh_seed())
        self._enter(rid)
        ids, logprobs, finish = [], [], {"type": "length", "length": sampling.max_new_tokens}
        cache, feed, version = None, torch.tensor([input_ids]), self.weight_version
        try:
            for _ in range(sampling.max_new_tokens):
                self._wait_while_paused(rid)
                with self._step_lock, torch.no_grad():
                    result = self.model(input_ids=feed, past_key_values=cache, use_cache=True)
                    version = self.weight_version
                cache = result.past_key_values
                log_probs = sampling_log_probs(result.logits[0, -1], sampling)
                token = _pick(log_probs, sampling, generator)
                ids.append(token)
                logprobs.append(log_probs[token].item())
                feed = torch.tensor([[token]])
                if token in sampling.stop_token_ids or (
                    token in self._eos and not sampling.ignore_eos
                ):
                    finish = {"type": "stop", "matched": token}
                    break
        except Aborted:
            finish, version = {"type": "abort", "message": "aborted"}, self.weight_version
        finally:
            self._leave(rid)
        return Output(ids, logprobs, finish, version, len(input_ids))

    def _enter(self, rid: str) -> None:
        with self._state:
            self._state.wait_for(lambda: self._paused is None)
            self._active.add(rid)

    def _leave(self, rid: str) -> None:
        with self._state:
            self._active.discard(rid)
            self._aborted.discard(rid)
            self._state.notify_all()

    def _wait_while_paused(self, rid: str) -> None:
        with self._state:
            self._state.wait_for(lambda: self._paused is None or rid in self._aborted)
            if rid in self._aborted:
                raise Aborted(rid)

    # --- control ------------------------------------------------------------------------

    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode must be abort, retract or in_place, got {mode!r}")
        with self._state:
            self._paused = mode
            if mode == "abort":
                self._aborted |= self._active
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

    def load_named_tensors(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy checkpoint-named tensors (save_pretrained names) into the live model.

        transformers keeps a MoE layer's experts fused in memory (experts.gate_up_proj
        [E, 2I, H] with gate first, experts.down_proj [E, H, I]); per-expert names are written
        into their slices. Unknown names and wrong shapes raise, naming the tensor.
        """
        params = dict(self.model.named_parameters())
        count = 0
        with self._step_lock, torch.no_grad():
            for name, tensor in tensors:
                _target_slice(params, name, tensor.shape).copy_(tensor)
                count += 1
        return count

    def read_named_tensor(self, name: str) -> torch.Tensor:
        return _target_slice(dict(self.model.named_parameters()), name, None).detach().clone()

    def load_from_disk(self, model_path: str | Path) -> int:
        reader = HFCheckpointReader(model_path)
        names = sorted(reader.tensors)
        chunk = 64  # read a few tensors at a time: bounded memory on big checkpoints
        return sum(
            self.load_named_tensors(reader.read(names[i : i + chunk]).items())
            for i in range(0, len(names), chunk)
        )


def _target_slice(params: dict, name: str, shape: torch.Size | None) -> torch.Tensor:
    match = _EXPERT.match(name)
    if match:
        prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
        if which == "down":
            target = params[f"{prefix}.down_proj"][expert]
        else:
            fused = params[f"{prefix}.gate_up_proj"][expert]
            half = fused.shape[0] // 2
            target = fused[:half] if which == "gate" else fused[half:]
    elif name in params:
        target = params[name]
    else:
        raise KeyError(f"{name}: no such tensor in the served model")
    if shape is not None and tuple(target.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {list(shape)} sent, the model has {list(target.shape)}")
    return target


def _pick(log_probs: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    if sampling.temperature == 0:
        return int(torch.argmax(log_probs))
    return int(torch.multinomial(log_probs.exp(), 1, generator=generator))


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _optional_tokenizer(model_path: str | Path):
    """The tokenizer if the directory has one; None serves input_ids-only requests (like
    SGLang's --skip-tokenizer-init)."""
    path = Path(model_path)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
