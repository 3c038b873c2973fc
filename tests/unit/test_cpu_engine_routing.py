"""The CPU engine's routed experts are SGLang's: meta_info.routed_experts decodes with SGLang's
own reader (srt/state_capturer/routed_experts.py: extract_routed_experts_from_meta_info, read
from the installed package) into [prompt + output - 1 - start, layers, top_k], and each
position's experts are the top-k of transformers' own router logits over the whole sequence;
routed_experts_start_len cuts the front as SGLang does, for each prompt of a batch; an engine
run without --enable-return-routed-experts sends none (as SGLang), a dense model with it
refuses the request. A request aborted while it waits for its first step is answered exactly
as SGLang's TokenizerManager._handle_abort_req answers one from its waiting queue (run from
the installed package), without routed experts, and the rollout client continues it: a routed
rollout survives the pause of a weight sync. /server_info carries SGLang's fields."""

from __future__ import annotations

import ast
import asyncio
import base64
import dataclasses
import logging
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from engine_harness import StepGate, hf_model, router_top_k, serving, until
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
from megatron_fr.engine.cpu.engine import CpuEngine
from megatron_fr.engine.cpu.server import CpuServer
from megatron_fr.engine.server_info import ENGINE_FIELD, INSTANCE_FIELD, identify
from megatron_fr.engine.sglang.protocol import RoutedExpertsLayout, SamplingParams
from megatron_fr.engine.sglang.source import exec_function, function_source, sglang_root

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


def generate(model_dir, body: dict, enabled: bool = True):
    async def main():
        engine = CpuEngine(model_dir, context_length=256, return_routed_experts=enabled)
        server = CpuServer(engine)
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


def test_not_asked_or_not_enabled_none_sent_and_a_dense_model_refuses(model_dirs):
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}}
    status, answer = generate(model_dirs / "moe", body)
    assert status == 200 and "routed_experts" not in answer["meta_info"]
    asked = {**body, "return_routed_experts": True}
    status, answer = generate(model_dirs / "moe", asked, enabled=False)
    assert status == 200 and "routed_experts" not in answer["meta_info"]  # SGLang's silence
    status, answer = generate(model_dirs / "dense", {**body, "return_routed_experts": True})
    assert status == 400
    assert answer["error"]["message"] == "return_routed_experts: this model has no MoE router"


TOKENIZER_MANAGER = "srt/managers/tokenizer_manager.py"


def sglang_waiting_abort(rid: str, version: str, e2e_latency: float) -> dict:
    """What SGLang 0.5.23 answers a request with return_logprob that a pause (mode abort)
    removed from its scheduler's waiting queue: Scheduler.abort_request sends
    _make_abort_req(req) (its weight-version spans, no token), and
    TokenizerManager._handle_abort_req builds the answer, with add_logprob_to_meta_info:
    their code, read from the installed package, run on that request's state."""

    @dataclasses.dataclass
    class WeightVersionSpan:
        version: str
        start: int
        end: int

    namespace = {
        "WeightVersionSpan": WeightVersionSpan,
        "logger": logging.getLogger("sglang"),
        "is_health_check_generate_req": lambda obj: False,
        "get_serving": lambda: SimpleNamespace(skip_tokenizer_init=False),
    }
    for name in ("compute_weight_version_spans", "add_weight_versions_to_meta_info"):
        exec_function(function_source("srt/utils/weight_versions.py", name), name, namespace)
    methods = {
        name: exec_function(
            function_source(TOKENIZER_MANAGER, name, "TokenizerManager"), name, namespace
        )
        for name in ("_handle_abort_req", "add_logprob_to_meta_info", "detokenize_logprob_tokens")
    }
    request = SimpleNamespace(
        stream=False,
        return_logprob=True,
        top_logprobs_num=0,
        token_ids_logprob=None,
        return_text_in_logprobs=False,
    )
    state = SimpleNamespace(
        finished=False,
        obj=request,
        output_ids=[],
        get_text=lambda: "",
        prompt_token_ids=None,
        time_stats=SimpleNamespace(
            set_finished_time=lambda: None, get_e2e_latency=lambda: e2e_latency
        ),
        out_list=[],
        event=SimpleNamespace(set=lambda: None),
        **{
            f"{side}_token_logprobs{part}": []
            for side in ("input", "output")
            for part in ("", "_val", "_idx")
        },
    )
    manager = SimpleNamespace(
        rid_to_state={rid: state},
        config_value=lambda name: version,
        incremental_streaming_output=False,
        _release_lora_once=lambda state: None,
    )
    for name in ("add_logprob_to_meta_info", "detokenize_logprob_tokens"):
        setattr(manager, name, lambda *a, _f=methods[name], **k: _f(manager, *a, **k))
    spans = namespace["compute_weight_version_spans"]([], version, 0)
    abort = SimpleNamespace(
        rid=rid, abort_message=None, finished_reason=None, weight_versions=spans
    )
    methods["_handle_abort_req"](manager, abort)
    return state.out_list[0]


def test_a_routed_rollout_survives_a_sync_that_aborts_requests_still_waiting(model_dirs):
    """A holds the decoding step when a weight sync pauses the engine (mode abort); B (plain
    HTTP) and C (the rollout client) wait for the step, as requests wait in SGLang's waiting
    queue. B's answer is SGLang's own for such a request: no token, no routed experts. After
    /continue_generation the client has continued A (aborted after one token) and C (aborted
    with none), and both rollouts carry the routed experts of every fed position: transformers'
    router top-k."""
    engine = CpuEngine(model_dirs / "moe", context_length=256, return_routed_experts=True)
    gate = StepGate(engine, {})
    layout = RoutedExpertsLayout(num_layers=2, top_k=2, num_experts=4)
    sampling = SamplingParams(max_new_tokens=NEW)
    waiting = {
        "input_ids": PROMPTS[1],
        "rid": "b",
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": NEW},
    }
    prompt_c = [7, 7, 30, 2, 11]

    async def scenario(url: str, http: aiohttp.ClientSession, client: RolloutClient):
        gate.hold_at(1)
        a = asyncio.create_task(client.generate(PROMPTS[0], sampling))
        await gate.held()
        b = asyncio.create_task(http.post(url + "/generate", json=waiting))
        c = asyncio.create_task(client.generate(prompt_c, sampling))
        await until(lambda: engine.running_requests == 3, "B and C waiting")
        async with http.post(url + "/pause_generation", json={"mode": "abort"}) as response:
            assert response.status == 200
        gate.go()
        async with await b as response:
            answer_b = await response.json()
        async with http.post(url + "/continue_generation", json={}) as response:
            assert response.status == 200
        return answer_b, await a, await c, client.metrics.continuations

    async def main():
        async with serving(engine) as (url, _), aiohttp.ClientSession() as http:
            config = RolloutClientConfig(urls=[url], routed_experts=layout)
            async with RolloutClient(config) as client:
                return await scenario(url, http, client)

    answer_b, rollout_a, rollout_c, continuations = asyncio.run(main())
    expected = sglang_waiting_abort(
        "b", engine.weight_version, answer_b["meta_info"]["e2e_latency"]
    )
    assert answer_b == expected and "routed_experts" not in answer_b["meta_info"]
    assert continuations == 2 and (rollout_a.continuations, rollout_c.continuations) == (1, 1)
    model = hf_model(model_dirs / "moe")
    for prompt, rollout in ((PROMPTS[0], rollout_a), (prompt_c, rollout_c)):
        assert rollout.finish_reason == "length" and len(rollout.output_ids) == NEW
        fed = prompt + rollout.output_ids[:-1]
        assert rollout.routed_experts.positions == len(fed)
        experts = np.sort(rollout.routed_experts.experts.astype(np.int64), axis=-1)
        np.testing.assert_array_equal(experts, router_top_k(model, fed, top_k=2))


def test_server_info_has_sglangs_fields_and_names_the_engine(model_dirs):
    """Every field but the engine's name and instance id is a field of SGLang's ServerArgs,
    and the one reader of /server_info (engine/server_info.py) sizes the CPU engine from it."""
    fields = {
        stmt.target.id
        for path in (sglang_root() / "srt/arg_groups/fields").glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
        for stmt in node.body
        if isinstance(stmt, ast.AnnAssign)
    }

    async def main(enabled: bool):
        engine = CpuEngine(model_dirs / "moe", context_length=256, return_routed_experts=enabled)
        async with serving(engine) as (url, _), aiohttp.ClientSession() as http:
            async with http.get(url + "/server_info") as response:
                info = await response.json()
            return info, await asyncio.to_thread(identify, url, 5.0)

    for enabled in (True, False):
        info, identified = asyncio.run(main(enabled))
        assert set(info) - {ENGINE_FIELD, INSTANCE_FIELD} <= fields, set(info) - fields
        assert identified.instance == info[INSTANCE_FIELD] and len(identified.instance) == 32
        assert info["enable_return_routed_experts"] is enabled
        assert (identified.kind, identified.tp_size, identified.pp_size) == ("cpu", 1, 1)
        assert (identified.dp_replicas, identified.routed_experts) == (1, enabled)
