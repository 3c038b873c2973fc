"""The one interface through which the project talks to an inference engine, whatever serves it.

SGLang, vLLM and the project's CPU engine (which speaks SGLang's wire) differ in their routes
and bodies, not in what the project asks of them: generate token in / token out with the
sampled tokens' log-probs and weight versions, say which weights they serve, pause and resume
generation around a weight sync, label their weights with a version and empty their prefix
cache. EngineWire is that set; engine/sglang/wire.py and engine/vllm/wire.py implement it, and
everything past the wire (the rollout client, the pool's supervisor, the weight sync and its
probe) is written once against it. How weights move into an engine is a weight transport's
job (weights/transports/), chosen by the engines' kind.

One run speaks to engines of one kind: `wire_for` picks the implementation from
rollout.engine.kind, or from what the engines given by URL say they are (engine/server_info.py).
"""

from __future__ import annotations

from typing import Protocol

from megatron_fr.engine.server_info import EngineKind
from megatron_fr.engine.types import GenerateOutput, PauseMode, SamplingParams


class EngineWire(Protocol):
    kind: str
    generate_path: str
    """POST: one prompt's generation (generate_request's body, parse_generate's answer)."""
    version_path: str
    """GET: {"weight_version": str}, the version the engine's weights carry. It runs no
    generation, so an engine paused by a long weight sync still answers it (the pool's
    liveness check)."""

    def generate_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routed_experts_start_len: int | None = None,
        top_logprobs_num: int = 0,
    ) -> dict[str, object]:
        """Body of generate_path: the output tokens' log-probs of the distribution sampled from;
        a request this engine cannot honour raises ValueError before anything is sent."""
        ...

    def parse_generate(self, body: object, top_logprobs_num: int = 0) -> GenerateOutput:
        """The answer of generate_path read strictly (MalformedResponse naming the field)."""
        ...

    def pause(self, url: str, mode: PauseMode, timeout_s: float) -> None:
        """Stop generating; "abort" ends requests in flight with finish_reason "abort" and the
        tokens so far (the rollout client continues them after the sync)."""
        ...

    def resume(self, url: str, timeout_s: float) -> None: ...

    def set_version(self, url: str, version: str, timeout_s: float) -> None:
        """Label the engine's weights `version` (what version_path then answers, and every
        token generated from now on carries)."""
        ...

    def flush_cache(self, url: str, timeout_s: float) -> None:
        """Empty the prefix cache, so no KV computed by older weights is reused."""
        ...


def wire_for(kind: EngineKind) -> EngineWire:
    """The wire engines of `kind` speak (the CPU engine speaks SGLang's)."""
    if kind == "vllm":
        from megatron_fr.engine.vllm.wire import VLLM_WIRE

        return VLLM_WIRE
    from megatron_fr.engine.sglang.wire import SGLANG_WIRE

    return SGLANG_WIRE
