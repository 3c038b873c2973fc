"""Per-token weight versions and atomic weight updates of the CPU engine, checked independently
of the engine's own bookkeeping: every token's reported version must be the version of the
weights that produced it, judged by (1) its log-prob recomputed with transformers on the
checkpoint of that version and (2) the live weights fingerprinted at every decoding step
(engine_harness.StepGate). Checkpoint "a" is served as version "default", "b" is sent as "2".
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import numpy as np
import pytest
import torch
from engine_harness import (
    PROMPT,
    StepGate,
    carried_cache_log_probs,
    full_sequence_log_probs,
    hf_model,
    router_top_k,
    serving,
)
from tiny_qwen import saved_tensors, tiny_checkpoint

from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
from megatron_fr.engine.cpu import weights as cpu_weights
from megatron_fr.engine.cpu.engine import CpuEngine
from megatron_fr.engine.sglang.protocol import (
    RoutedExpertsLayout,
    SamplingParams,
    parse_generate_response,
)

LABEL = {"a": "default", "b": "2"}
"""Checkpoint -> the version it is served as."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    tiny_checkpoint("qwen3_moe", root / "a", seed=0)
    tiny_checkpoint("qwen3_moe", root / "b", seed=1)
    return {"a": root / "a", "b": root / "b"}


class TensorFeed:
    """Stands in for the weight-update group's receiver (the transport is not what is tested
    here; tests/distributed/test_weight_group.py tests it against SGLang's own code): each
    bucket received is the next tensors sent, in their shapes."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.queue = list(tensors)
        self.groups = {"weight_update_group": None}

    def receive(self, names, dtypes, shapes, group_name, load_format) -> list:
        return [
            (name, self.queue.pop(0).reshape(shape))
            for name, shape in zip(names, shapes, strict=True)
        ]


async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> tuple[int, object]:
    async with http.post(url + path, json=body) as response:
        return response.status, await response.json(content_type=None)


async def post_ok(http: aiohttp.ClientSession, url: str, path: str, body: dict) -> object:
    status, answer = await post(http, url, path, body)
    assert status == 200, (path, answer)
    return answer


def bucket_bodies(path, count: int = 3, version: str | None = None) -> tuple[list[dict], list]:
    """/update_weights_from_distributed bodies sending checkpoint `path` in `count` buckets
    (`version` on the last one), and the tensors in broadcast order."""
    named = list(saved_tensors(path).items())
    size = -(-len(named) // count)
    bodies = []
    for start in range(0, len(named), size):
        part = named[start : start + size]
        bodies.append(
            {
                "names": [name for name, _ in part],
                "dtypes": ["float32"] * len(part),
                "shapes": [list(tensor.shape) for _, tensor in part],
                "group_name": "weight_update_group",
                "weight_version": version if start + size >= len(named) else None,
            }
        )
    return bodies, [tensor for _, tensor in named]


async def send_buckets(http, url, server, path, session_version: str | None = None) -> None:
    """The project's weight-sync order: begin, buckets, end, then /update_weight_version."""
    bodies, tensors = bucket_bodies(path)
    server.receiver = TensorFeed(tensors)
    await post_ok(http, url, "/begin_weight_update", {})
    for body in bodies:
        await post_ok(http, url, "/update_weights_from_distributed", body)
    await post_ok(http, url, "/end_weight_update", {})
    if session_version is not None:
        body = {"new_version": session_version, "abort_all_requests": False}  # as WeightSync
        await post_ok(http, url, "/update_weight_version", body)


SPLIT, LENGTH = 6, 20


@pytest.mark.parametrize("transport", ["disk", "buckets"])
@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_each_token_carries_the_version_of_the_weights_that_produced_it(ckpt, mode, transport):
    """Weights updated after token SPLIT of a generation, under each pause mode; the rollout
    client continues an aborted request."""
    engine = CpuEngine(ckpt["a"], context_length=256)
    gate = StepGate(engine, ckpt)

    async def main():
        async with (
            serving(engine) as (url, server),
            RolloutClient(RolloutClientConfig(urls=[url])) as client,
            aiohttp.ClientSession() as http,
        ):
            gate.hold_at(SPLIT)
            sampling = SamplingParams(max_new_tokens=LENGTH, temperature=1.0)
            rollout = asyncio.create_task(client.generate(PROMPT, sampling))
            await gate.held()  # inside the step that samples token SPLIT - 1
            await post_ok(http, url, "/pause_generation", {"mode": mode})
            gate.go()
            if transport == "disk":
                body = {"model_path": str(ckpt["b"]), "weight_version": "2"}
                await post_ok(http, url, "/update_weights_from_disk", body)
            else:
                await send_buckets(http, url, server, ckpt["b"], session_version="2")
            await post_ok(http, url, "/continue_generation", {})
            return await rollout

    rollout = asyncio.run(main())
    assert rollout.continuations == (1 if mode == "abort" else 0)
    assert rollout.token_versions == ["default"] * SPLIT + ["2"] * (LENGTH - SPLIT)
    assert [LABEL[label] for label in gate.seen] == rollout.token_versions
    a, b = hf_model(ckpt["a"]), hf_model(ckpt["b"])
    ids = rollout.output_ids
    if mode == "in_place":  # the running request keeps the cache the old weights encoded
        reference = carried_cache_log_probs([a] * SPLIT + [b] * (LENGTH - SPLIT), PROMPT, ids)
    else:  # aborted and continued, or retracted: the new weights re-encode the whole prefix
        on_b = full_sequence_log_probs(b, PROMPT, ids)
        reference = torch.cat([full_sequence_log_probs(a, PROMPT, ids)[:SPLIT], on_b[SPLIT:]])
    engine_lp = torch.tensor(rollout.output_logprobs)
    assert (engine_lp - reference).abs().max() <= 1e-5
    wrong = full_sequence_log_probs(a, PROMPT, ids)[SPLIT:]  # as if tagged "default"
    assert (engine_lp[SPLIT:] - wrong).abs().max() > 1e-2, "the versions must be tellable apart"


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_routed_experts_are_those_of_the_weights_that_fed_each_position(ckpt, mode):
    """Weights updated after token SPLIT, routed experts asked for. Aborted and continued: the
    positions fed before the update were routed by "a", the continuation reports only the
    positions after them, routed by "b". Retracted: "b" re-encodes the whole prefix, so every
    position is routed by "b" (as SGLang re-prefills a retracted request)."""
    engine = CpuEngine(ckpt["a"], context_length=256, return_routed_experts=True)
    gate = StepGate(engine, ckpt)
    layout = RoutedExpertsLayout(num_layers=2, top_k=2, num_experts=4)

    async def main():
        async with (
            serving(engine) as (url, _),
            RolloutClient(RolloutClientConfig(urls=[url], routed_experts=layout)) as client,
            aiohttp.ClientSession() as http,
        ):
            gate.hold_at(SPLIT)
            sampling = SamplingParams(max_new_tokens=LENGTH, temperature=1.0)
            rollout = asyncio.create_task(client.generate(PROMPT, sampling))
            await gate.held()
            await post_ok(http, url, "/pause_generation", {"mode": mode})
            gate.go()
            body = {"model_path": str(ckpt["b"]), "weight_version": "2"}
            await post_ok(http, url, "/update_weights_from_disk", body)
            await post_ok(http, url, "/continue_generation", {})
            return await rollout

    rollout = asyncio.run(main())
    fed = PROMPT + rollout.output_ids[:-1]
    on_a = router_top_k(hf_model(ckpt["a"]), fed, top_k=2)
    on_b = router_top_k(hf_model(ckpt["b"]), fed, top_k=2)
    cut = len(PROMPT) + SPLIT - 1  # the prompt and tokens 0 .. SPLIT - 2 were fed by "a"
    expected = np.concatenate([on_a[:cut], on_b[cut:]]) if mode == "abort" else on_b
    np.testing.assert_array_equal(np.sort(rollout.routed_experts.experts, axis=-1), expected)
    assert (on_a[:cut] != on_b[:cut]).any(), "the two checkpoints must route differently"


async def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 120  # hang guard only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport", ["disk", "buckets"])
def test_updates_without_a_pause_never_run_a_step_on_half_loaded_weights(
    ckpt, transport, monkeypatch
):
    """No pause at all: multi-bucket updates with decoding steps held between the buckets, or a
    disk load read in many slow chunks, while a long request keeps generating."""
    engine = CpuEngine(ckpt["a"], context_length=1024)
    gate = StepGate(engine, ckpt)
    if transport == "disk":
        monkeypatch.setattr(cpu_weights, "DISK_CHUNK_TENSORS", 4)
        read = cpu_weights.HFCheckpointReader.read

        def slow_read(self, names):
            time.sleep(0.02)  # leaves room for steps between chunks, if anything allowed them
            return read(self, names)

        monkeypatch.setattr(cpu_weights.HFCheckpointReader, "read", slow_read)

    async def main():
        async with serving(engine) as (url, server), aiohttp.ClientSession() as http:
            gate.hold_at(4)
            body = {"input_ids": PROMPT, "rid": "long", "sampling_params": {"max_new_tokens": 900}}
            long = asyncio.create_task(post(http, url, "/generate", body))
            await gate.held()
            if transport == "disk":
                body = {"model_path": str(ckpt["b"]), "weight_version": "2"}
                load = asyncio.create_task(post_ok(http, url, "/update_weights_from_disk", body))
                gate.go()
                await load
            else:
                bodies, tensors = bucket_bodies(ckpt["b"], version="2")
                server.receiver = TensorFeed(tensors)
                await post_ok(http, url, "/begin_weight_update", {})
                for hold, bucket in zip([8, 12, None], bodies, strict=True):
                    await post_ok(http, url, "/update_weights_from_distributed", bucket)
                    if hold is None:  # the swap needs the step the thread is held in to end
                        end = asyncio.create_task(post_ok(http, url, "/end_weight_update", {}))
                    gate.go(hold)
                    if hold is not None:
                        await gate.held()
                await end
            after = gate.calls
            await _wait_for(lambda: gate.calls >= after + 4, "steps after the update")
            await post_ok(http, url, "/abort_request", {"rid": "long"})
            return (await long)[1]

    out = parse_generate_response(asyncio.run(main()))
    assert "mixed" not in gate.seen, gate.seen
    assert [LABEL[label] for label in gate.seen] == out.token_versions
    assert gate.seen[:4] == ["a"] * 4 and gate.seen[-1] == "b"
    if transport == "buckets":
        assert gate.seen[:12] == ["a"] * 12, "steps between the buckets ran on the old weights"
    models = {"a": hf_model(ckpt["a"]), "b": hf_model(ckpt["b"])}
    reference = carried_cache_log_probs([models[s] for s in gate.seen], PROMPT, out.output_ids)
    assert (torch.tensor(out.output_logprobs) - reference).abs().max() <= 1e-5


def test_session_versions_refused_buckets_and_unended_sessions(ckpt):
    """A version named inside a session waits for its weights; a refused bucket discards the
    whole session; a session that never ends changes nothing."""
    engine = CpuEngine(ckpt["a"], context_length=256)
    gate = StepGate(engine, ckpt)

    async def main():
        async with serving(engine) as (url, server), aiohttp.ClientSession() as http:
            bodies, tensors = bucket_bodies(ckpt["b"])
            server.receiver = TensorFeed(tensors)
            await post_ok(http, url, "/begin_weight_update", {})
            await post_ok(http, url, "/update_weights_from_distributed", bodies[0])
            body = {"new_version": "7", "abort_all_requests": False}
            await post_ok(http, url, "/update_weight_version", body)
            async with http.get(url + "/model_info") as response:
                during = await response.json()
            bad = dict(bodies[1], shapes=[[3, 3], *bodies[1]["shapes"][1:]])
            refused = await post(http, url, "/update_weights_from_distributed", bad)
            discarded = await post(http, url, "/end_weight_update", {})
            after_discard = (gate.identify(), engine.weight_version)
            await post_ok(http, url, "/begin_weight_update", {})  # never ended
            server.receiver = TensorFeed(tensors)
            for body in bucket_bodies(ckpt["b"], version="9")[0]:
                await post_ok(http, url, "/update_weights_from_distributed", body)
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
            unended = parse_generate_response(await post_ok(http, url, "/generate", body))
            return during, refused, discarded, after_discard, unended

    during, refused, discarded, after_discard, unended = asyncio.run(main())
    assert during["weight_version"] == "default", "version 7 names weights not yet live"
    assert refused[0] == 400 and "shape [3, 3] sent" in refused[1]["error"]["message"]
    assert discarded[0] == 400
    assert "discarded, nothing applied" in discarded[1]["error"]["message"]
    assert after_discard == ("a", "default")
    assert unended.token_versions == ["default"] * 3 and gate.seen[-3:] == ["a"] * 3


def test_a_disk_load_failing_half_way_stops_decoding_until_a_complete_update(ckpt, monkeypatch):
    engine = CpuEngine(ckpt["a"], context_length=256)
    gate = StepGate(engine, ckpt)
    monkeypatch.setattr(cpu_weights, "DISK_CHUNK_TENSORS", 4)
    read, calls = cpu_weights.HFCheckpointReader.read, []

    def failing_read(self, names):
        calls.append(names)
        if len(calls) == 2:
            raise OSError("disk gone")
        return read(self, names)

    monkeypatch.setattr(cpu_weights.HFCheckpointReader, "read", failing_read)
    generate = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}

    async def main():
        async with serving(engine) as (url, _server), aiohttp.ClientSession() as http:
            missing = await post(http, url, "/update_weights_from_disk", {"model_path": "/nope"})
            untouched = gate.identify()
            failed = await post(
                http, url, "/update_weights_from_disk", {"model_path": str(ckpt["b"])}
            )
            refused = await post(http, url, "/generate", generate)
            body = {"model_path": str(ckpt["b"]), "weight_version": "3"}
            await post_ok(http, url, "/update_weights_from_disk", body)
            return (
                missing,
                untouched,
                failed,
                refused,
                await post_ok(http, url, "/generate", generate),
            )

    missing, untouched, failed, refused, recovered = asyncio.run(main())
    assert missing[0] == 400 and "/nope" in missing[1]["error"]["message"] and untouched == "a"
    assert failed[0] == 503 and "failed half-way (disk gone)" in failed[1]["error"]["message"]
    assert refused[0] == 503 and "update again" in refused[1]["error"]["message"]
    assert recovered["meta_info"]["weight_versions"] == [{"version": "3", "start": 0, "end": 2}]
    assert gate.seen == ["b", "b"]
