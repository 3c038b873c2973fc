"""The CPU engine's routed experts are SGLang's: meta_info.routed_experts decodes with SGLang's
own reader (srt/state_capturer/routed_experts.py: extract_routed_experts_from_meta_info, read
from the installed package) into [prompt + output - 1 - start, layers, top_k], and each
position's experts are the top-k of transformers' own router logits over the whole sequence;
routed_experts_start_len cuts the front as SGLang does, for each prompt of a batch; a dense
model refuses the request."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from engine_harness import hf_model, router_top_k
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.cpu_engine import CpuEngine
from megatron_fr.engine.cpu_server import CpuServer
from megatron_fr.engine.sglang_source import exec_function, function_source

PROMPTS = [[3, 17, 42, 5], [9, 8, 100]]
NEW = 7


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    tiny_checkpoint("qwen3_moe", root / "moe", seed=0)
    tiny_checkpoint("qwen3", root / "dense", seed=0)
    return root


def sglang_reader():
    source = function_source(
        "srt/state_capturer/routed_experts.py", "extract_routed_experts_from_meta_info"
    )
    namespace = {"np": np, "pybase64": base64}
    return exec_function(source, "extract_routed_experts_from_meta_info", namespace)


def generate(model_dir, body: dict):
    async def main():
        server = CpuServer(CpuEngine(model_dir, context_length=256))
        async with TestClient(TestServer(server.app())) as client:
            response = await client.post("/generate", json=body)
            return response.status, await response.json()

    return asyncio.run(main())


def test_routed_experts_are_sglangs_payload_of_the_models_own_top_k(model_dirs):
    sampling = {"max_new_tokens": NEW, "sampling_seed": 3, "ignore_eos": True}
    body = {"input_ids": PROMPTS, "sampling_params": sampling, "return_routed_experts": True}
    status, whole = generate(model_dirs / "moe", body)
    assert status == 200
    status, tail = generate(model_dirs / "moe", {**body, "routed_experts_start_len": 2})
    assert status == 200
    read = sglang_reader()
    for prompt, answer, cut in zip(PROMPTS, whole, tail, strict=True):
        fed = prompt + answer["output_ids"][:-1]  # the last token is never fed
        experts = read(answer).reshape(-1, 2, 2)
        assert experts.shape[0] == len(prompt) + NEW - 1
        reference = router_top_k(hf_model(model_dirs / "moe"), fed, top_k=2)
        np.testing.assert_array_equal(np.sort(experts, axis=-1), reference)
        assert cut["output_ids"] == answer["output_ids"]  # same seed, same tokens
        np.testing.assert_array_equal(read(cut).reshape(-1, 2, 2), experts[2:])


def test_not_asked_none_sent_and_a_dense_model_refuses(model_dirs):
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    status, answer = generate(model_dirs / "moe", body)
    assert status == 200 and "routed_experts" not in answer["meta_info"]
    status, answer = generate(model_dirs / "dense", {**body, "return_routed_experts": True})
    assert status == 400
    assert answer["error"]["message"] == "return_routed_experts: this model has no MoE router"
