"""SGLang's side of the engine interface (engine/wire.py), which the CPU engine speaks too: the
request bodies and parsing are protocol.py's, the control calls its routes."""

from __future__ import annotations

from megatron_fr.engine import http
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.types import GenerateOutput, PauseMode, SamplingParams


class SGLangWire:
    kind = "sglang"
    generate_path = protocol.GENERATE_PATH
    version_path = http.MODEL_INFO_PATH

    def generate_request(
        self,
        input_ids: list[int],
        sampling: SamplingParams,
        *,
        rid: str | None = None,
        routed_experts_start_len: int | None = None,
        top_logprobs_num: int = 0,
    ) -> dict[str, object]:
        return protocol.generate_request(
            input_ids,
            sampling,
            rid=rid,
            routed_experts_start_len=routed_experts_start_len,
            top_logprobs_num=top_logprobs_num,
        )

    def parse_generate(self, body: object, top_logprobs_num: int = 0) -> GenerateOutput:
        return protocol.parse_generate_response(body, top_logprobs_num)

    def pause(self, url: str, mode: PauseMode, timeout_s: float) -> None:
        body = protocol.pause_generation_request(mode)
        http.post_json(url, protocol.PAUSE_GENERATION_PATH, body, timeout_s)

    def resume(self, url: str, timeout_s: float) -> None:
        body = protocol.continue_generation_request()
        http.post_json(url, protocol.CONTINUE_GENERATION_PATH, body, timeout_s)

    def set_version(self, url: str, version: str, timeout_s: float) -> None:
        body = protocol.update_weight_version_request(version)
        http.post_json(url, protocol.UPDATE_WEIGHT_VERSION_PATH, body, timeout_s)

    def flush_cache(self, url: str, timeout_s: float) -> None:
        http.flush_cache(url, timeout_s)


SGLANG_WIRE = SGLangWire()
