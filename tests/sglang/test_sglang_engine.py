"""Real SGLang 0.5.23 on CPU (one server for the tier: conftest.py), spoken to through the
project's SGLang wire (engine/sglang/): generation with input ids equals transformers' greedy
with log-probs close to transformers' own; the top-K log-prob layout SGLang sends is read by
the project's parser; pause (abort and in_place) and continue with a request in flight; a
weight push over the real session protocol (begin / update_weights_from_distributed / end)
through the project's broadcast transport on gloo serves the pushed model; an update outside a
session is refused cleanly (an error, no hang); and a connect of the weight sync while a long
generation is in flight ends within the regroup bound and takes no engine out (weights/sync.py:
no session call to a serving engine; SGLang's writer lock would make it wait for the
generation)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from test_sglang_differential import SGLANG_ONLY_META
from vllm_servers import PROMPT, TINY_QWEN3

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine.cpu.engine import Output
from megatron_fr.engine.cpu.wire import waiting_abort_response
from megatron_fr.engine.sglang import launch as sglang_launch
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.sglang.wire import SGLANG_WIRE
from megatron_fr.utils.net import free_port
from megatron_fr.weights.sync import WeightSync
from megatron_fr.weights.transports import Engine, build_transport

pytestmark = pytest.mark.sglang
LONG = 4000
"""Tokens of a request that must still be running when the test acts on it (SGLang decodes a
few to some tens of tokens a second on a loaded 2-core machine)."""


def _post(url: str, path: str, body: dict, timeout_s: float = 300) -> dict:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def _generate(url: str, max_new_tokens: int, temperature: float = 0.0, **extra) -> dict:
    sampling = protocol.SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    body = protocol.generate_request(PROMPT, sampling, **extra)
    body["sampling_params"]["ignore_eos"] = True  # type: ignore[index]
    return _post(url, protocol.GENERATE_PATH, body)


def _in_background(
    url: str, max_new_tokens: int, settle_s: float = 2.0
) -> tuple[threading.Thread, list[dict]]:
    """A sampled request in a thread of its own (its answer lands in the list), given
    `settle_s` to be admitted and decoding."""
    answers: list[dict] = []
    thread = threading.Thread(target=lambda: answers.append(_generate(url, max_new_tokens, 1.0)))
    thread.start()
    time.sleep(settle_s)
    return thread, answers


def _reference(model, ids: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of PROMPT for len(ids) tokens and the log-probs of
    `ids` under the model."""
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in ids:
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1].double()
    log_probs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    return tokens[len(PROMPT) :], log_probs.tolist()


def test_greedy_ids_and_log_probs_are_transformers(sglang_server) -> None:
    url, model = sglang_server
    out = protocol.parse_generate_response(_generate(url, 12))
    greedy, log_probs = _reference(model, out.output_ids)
    assert out.output_ids == greedy and out.finish_reason == "length"
    gaps = [abs(a - b) for a, b in zip(out.output_logprobs, log_probs, strict=True)]
    assert max(gaps) < 0.02, gaps  # bf16 weights in SGLang against float32 here


def test_top_k_log_probs_as_sglang_sends_them_are_read(sglang_server) -> None:
    url, _ = sglang_server
    answer = _generate(url, 6, top_logprobs_num=3)
    out = protocol.parse_generate_response(answer, top_logprobs_num=3)
    assert out.top_logprobs is not None and out.top_logprobs.ids.shape == (
        6 - out.top_logprobs_from,
        3,
    )
    rows = answer["meta_info"]["output_top_logprobs"][out.top_logprobs_from :]
    assert out.top_logprobs.ids.tolist() == [[entry[1] for entry in row] for row in rows]
    # greedy: the sampled token is the most likely one
    assert out.top_logprobs.ids[:, 0].tolist() == out.output_ids[out.top_logprobs_from :]


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_pause_and_continue_with_a_request_in_flight(sglang_server, mode) -> None:
    url, _ = sglang_server
    thread, answers = _in_background(url, LONG)
    SGLANG_WIRE.pause(url, mode, 60.0)
    try:
        if mode == "in_place":
            time.sleep(1.0)
            assert thread.is_alive(), "an in-place pause keeps the request"
    finally:
        SGLANG_WIRE.resume(url, 60.0)
    if mode == "in_place":  # end it: its tokens are not what this test is about
        SGLANG_WIRE.pause(url, "abort", 60.0)
        SGLANG_WIRE.resume(url, 60.0)
    thread.join(timeout=120)
    out = protocol.parse_generate_response(answers[0])
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < LONG


def test_requests_aborted_in_the_waiting_queue_are_read_as_aborts(sglang_server) -> None:
    """More long requests than SGLang runs at once (the launcher's --max-running-requests),
    then a pause with abort: the requests still in SGLang's waiting queue come back with its
    own waiting-queue answer (no token), which the project's wire reads as an abort with no
    tokens (the client continues it like any abort), and whose fields are those of the CPU
    engine's imitation of it (engine/cpu/wire.py: waiting_abort_response)."""
    url, _ = sglang_server
    flags = {flag[0]: flag[1:] for flag in sglang_launch.CPU_FLAGS}
    running = int(flags["--max-running-requests"][0])
    started = [_in_background(url, LONG, settle_s=0.0) for _ in range(running + 2)]
    time.sleep(3.0)  # the first `running` admitted and decoding, the others waiting
    SGLANG_WIRE.pause(url, "abort", 60.0)
    SGLANG_WIRE.resume(url, 60.0)
    answers = []
    for thread, answered in started:
        thread.join(timeout=120)
        answers += answered
    assert len(answers) == running + 2
    waited = [a for a in answers if not a["output_ids"]]
    assert waited, [len(a["output_ids"]) for a in answers]  # some never ran
    for answer in waited:
        out = protocol.parse_generate_response(answer)
        assert out.finish_reason == "abort" and out.output_ids == [] == out.output_logprobs
    imitation = waiting_abort_response(
        Output([], [], {"type": "abort", "message": "x"}, "0", 0, waiting_abort=True), "rid"
    )
    assert {key for a in waited for key in a} == set(imitation)
    # less the scheduler's bookkeeping SGLang adds to every answer and the project never reads
    # (test_sglang_differential.py: SGLANG_ONLY_META, each with its reason)
    bookkeeping = {name.removeprefix("meta_info.") for name in SGLANG_ONLY_META}
    sent = {key for a in waited for key in a["meta_info"]}
    assert sent - bookkeeping == set(imitation["meta_info"]), sent


def test_an_update_outside_a_session_is_refused_cleanly(sglang_server) -> None:
    url, _ = sglang_server
    body = protocol.update_weights_from_distributed_request(
        ["lm_head.weight"], ["float32"], [[256, 64]], group_name="no_such_group"
    )
    began = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as refused:
        _post(url, protocol.UPDATE_WEIGHTS_FROM_DISTRIBUTED_PATH, body, timeout_s=60)
    assert refused.value.code == 400 and time.monotonic() - began < 30
    assert "begin_weight_update" in refused.value.read().decode()


def test_a_push_over_the_session_protocol_serves_the_new_weights(sglang_server) -> None:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    url, _ = sglang_server
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**TINY_QWEN3)).eval()
    config = WeightSyncConfig(backend="gloo", master_port=free_port(), timeout_s=120)
    transport = build_transport(config, [Engine(url, 1, "sglang")], "weight_update_group_push")
    SGLANG_WIRE.pause(url, "abort", 60.0)
    try:
        transport.connect(0)
        transport.begin()
        transport.send(list(other.state_dict().items()))
        transport.finish_stage()
        transport.commit("3")
        transport.end()
        SGLANG_WIRE.set_version(url, "3", 60.0)
        SGLANG_WIRE.flush_cache(url, 60.0)
    finally:
        SGLANG_WIRE.resume(url, 60.0)
        transport.close()
    out = protocol.parse_generate_response(_generate(url, 12))
    greedy, log_probs = _reference(other, out.output_ids)
    assert out.output_ids == greedy and set(out.token_versions) == {"3"}
    gaps = [abs(a - b) for a, b in zip(out.output_logprobs, log_probs, strict=True)]
    assert max(gaps) < 0.03, gaps


def test_a_connect_while_a_long_generation_runs_takes_no_engine_out(sglang_server) -> None:
    """The connect's first call to an engine that may hold a session (here: never synced by
    this learner) pauses it first, so SGLang's session call does not wait behind the
    generation for the writer lock: the connect ends well within the regroup bound and the
    engine is not named unresponsive. Its request ends aborted (the rollout client continues
    such requests after the sync, which resumes the engine)."""
    url, _ = sglang_server
    thread, answers = _in_background(url, LONG)
    config = WeightSyncConfig(regroup_timeout_s=30, timeout_s=120, pause_mode="abort")
    sync = WeightSync(config, [Engine(url)], spec=None)  # type: ignore[arg-type]
    began = time.monotonic()
    try:
        engines = sync._adopt()
        took = time.monotonic() - began
    finally:
        SGLANG_WIRE.resume(url, 60.0)  # what the sync after every connect does at its end
    thread.join(timeout=120)
    assert [engine.url for engine in engines] == [url] and sync.take_unresponsive() == []
    assert took < 30, took
    out = protocol.parse_generate_response(answers[0])
    assert out.finish_reason == "abort" and len(out.output_ids) < LONG
    # an engine whose session this sync closed last is sent no session call and no pause
    sync.closed = {url}
    thread, answers = _in_background(url, 40)
    began = time.monotonic()
    sync._adopt()
    assert (time.monotonic() - began < 30 and thread.is_alive()) or answers
    thread.join(timeout=300)
    assert protocol.parse_generate_response(answers[0]).finish_reason == "length"
