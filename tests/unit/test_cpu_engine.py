"""The CPU engine over HTTP (in process): SGLang's fields, log-probs of the distribution really
sampled from, concurrency, pause / abort / continue, weight updates and versions."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.cpu.engine import CpuEngine, Sampling, sampling_log_probs
from megatron_fr.engine.cpu.server import CpuServer

PROMPT = [3, 17, 42, 5]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    tiny_checkpoint("qwen3_moe", root / "a", seed=0)
    tiny_checkpoint("qwen3_moe", root / "b", seed=1)
    return root


def serve(model_dir, scenario, max_concurrency: int = 32):
    """Run `await scenario(client, engine)` against a fresh server on the given model."""
    engine = CpuEngine(model_dir, context_length=1024)

    async def main():
        server = CpuServer(engine, max_concurrency)
        async with TestClient(TestServer(server.app())) as client:
            return await scenario(client, engine)

    return asyncio.run(main())


def body(max_new_tokens=8, seed=0, **sampling):
    params = {
        "max_new_tokens": max_new_tokens,
        "sampling_seed": seed,
        "ignore_eos": True,
        **sampling,
    }
    return {"input_ids": PROMPT, "sampling_params": params, "return_logprob": True}


def hf_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    """Independent reference: transformers' own logits over the whole sequence at once,
    [response length, vocab], row t predicting response token t."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0][len(PROMPT) - 1 : -1]


def hf_distributions(model_dir, tokens: list[int]) -> torch.Tensor:
    return torch.log_softmax(hf_logits(model_dir, tokens), -1)


def hf_log_probs(model_dir, tokens: list[int]) -> torch.Tensor:
    targets = torch.tensor(tokens[len(PROMPT) :])
    return hf_distributions(model_dir, tokens).gather(-1, targets[:, None])[:, 0]


def test_generate_returns_sglang_fields_and_the_models_own_log_probs(checkpoints):
    async def scenario(client, _engine):
        single = await (await client.post("/generate", json=body())).json()
        again = await (await client.post("/generate", json=body())).json()
        batched = await client.post(
            "/generate",
            json={"input_ids": [PROMPT, PROMPT[:2]], "sampling_params": {"max_new_tokens": 3}},
        )
        version = await (await client.get("/model_info")).json()
        return single, again, await batched.json(), version

    single, again, batched, version = serve(checkpoints / "a", scenario)
    meta = single["meta_info"]
    assert len(single["output_ids"]) == 8 and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 4 and meta["weight_version"] == "default"
    assert [entry[1] for entry in meta["output_token_logprobs"]] == single["output_ids"]
    assert all(entry[2] is None for entry in meta["output_token_logprobs"])
    assert again["output_ids"] == single["output_ids"], "same seed, same tokens"
    engine_lp = torch.tensor([entry[0] for entry in meta["output_token_logprobs"]])
    reference = hf_log_probs(checkpoints / "a", PROMPT + single["output_ids"])
    assert (engine_lp - reference).abs().max() <= 1e-5
    assert isinstance(batched, list) and [b["meta_info"]["prompt_tokens"] for b in batched] == [
        4,
        2,
    ]
    assert version["weight_version"] == "default"


def test_log_probs_are_those_of_the_truncated_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    # top-k 2 at temperature 0.5: softmax over the two largest of logits / 0.5
    two = torch.tensor([4.0, 2.0])
    expected = two - torch.logsumexp(two, 0)
    got = sampling_log_probs(logits, Sampling(temperature=0.5, top_k=2))
    assert torch.allclose(got[:2], expected) and torch.isinf(got[2:]).all()
    # top-p 0.8: probabilities 0.53, 0.20, 0.12, ... -> the first three reach 0.8
    probs = torch.softmax(logits, 0)
    assert probs[:2].sum() < 0.8 <= probs[:3].sum()
    kept = torch.log(probs[:3] / probs[:3].sum())
    got = sampling_log_probs(logits, Sampling(top_p=0.8))
    assert torch.allclose(got[:3], kept) and torch.isinf(got[3:]).all()


def test_top_k_sampling_reports_renormalised_log_probs(checkpoints):
    async def scenario(client, _engine):
        return await (await client.post("/generate", json=body(top_k=2))).json()

    answer = serve(checkpoints / "a", scenario)
    rows = hf_distributions(checkpoints / "a", PROMPT + answer["output_ids"])
    top2 = rows.topk(2, dim=-1)
    expected = []
    for row, (values, indices), token in zip(
        rows, zip(top2.values, top2.indices, strict=True), answer["output_ids"], strict=True
    ):
        assert token in indices.tolist(), "a token outside the top 2 was sampled"
        expected.append(row[token] - torch.logsumexp(values, 0))
    engine_lp = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    assert (engine_lp - torch.stack(expected)).abs().max() <= 1e-5


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_log_probs_at_temperature_0_6_are_transformers_logits_over_t(checkpoints, top_p):
    """The reported log-prob is log softmax(logits / 0.6), renormalised over the nucleus when
    top_p < 1 (the distribution the token was drawn from), against transformers' logits."""

    async def scenario(client, _engine):
        request = body(16, temperature=0.6, top_p=top_p)
        return await (await client.post("/generate", json=request)).json()

    answer = serve(checkpoints / "a", scenario)
    rows = hf_logits(checkpoints / "a", PROMPT + answer["output_ids"]) / 0.6
    expected, truncated = [], False
    for row, token in zip(rows, answer["output_ids"], strict=True):
        probs = torch.softmax(row.double(), -1)
        ranked, order = probs.sort(descending=True)
        kept = int(torch.searchsorted(ranked.cumsum(0), torch.tensor(top_p).double())) + 1
        kept = min(kept, len(order))
        truncated |= kept < len(order)
        assert token in order[:kept].tolist(), "a token outside the nucleus was sampled"
        expected.append(torch.log(probs[token] / ranked[:kept].sum()))
    engine_lp = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    assert (engine_lp.double() - torch.stack(expected)).abs().max() <= 1e-5
    assert truncated == (top_p < 1)


def test_top_logprobs_are_the_k_most_likely_of_transformers_logits_over_t(checkpoints):
    """top_logprobs_num = K: every output token's K most likely tokens and their log-probs
    under log softmax(logits / 0.6), in descending order, against transformers' logits; at
    top_k = 2 the truncated tokens' -inf comes as float32's smallest value (SGLang's clamp);
    K past the request bound is a 400 naming the field."""
    k = 5

    async def scenario(client, _engine):
        plain = await client.post(
            "/generate", json=body(8, temperature=0.6) | {"top_logprobs_num": k}
        )
        cut = await client.post("/generate", json=body(3, top_k=2) | {"top_logprobs_num": 3})
        huge = await client.post("/generate", json=body(2) | {"top_logprobs_num": 129})
        return await plain.json(), await cut.json(), huge.status, await huge.text()

    plain, cut, status, refusal = serve(checkpoints / "a", scenario)
    rows = torch.log_softmax(hf_logits(checkpoints / "a", PROMPT + plain["output_ids"]) / 0.6, -1)
    top = rows.topk(k, dim=-1)
    answer = plain["meta_info"]["output_top_logprobs"]
    assert plain["meta_info"]["input_top_logprobs"] == []
    assert [[entry[1] for entry in row] for row in answer] == top.indices.tolist()
    assert all(entry[2] is None for row in answer for entry in row)
    values = torch.tensor([[entry[0] for entry in row] for row in answer])
    assert (values - top.values).abs().max() <= 1e-5
    floor = torch.finfo(torch.float32).min
    assert [row[2][0] for row in cut["meta_info"]["output_top_logprobs"]] == [floor] * 3
    assert status == 400 and "top_logprobs_num must be in [0, 128], got 129" in refusal


def test_pause_abort_returns_partial_output_and_new_requests_wait_for_continue(checkpoints):
    async def scenario(client, engine):
        long = asyncio.create_task(client.post("/generate", json=body(max_new_tokens=400)))
        while engine.active_requests == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        await client.post("/pause_generation", json={"mode": "abort"})
        aborted = await (await long).json()
        waiting = asyncio.create_task(client.post("/generate", json=body(max_new_tokens=2)))
        await asyncio.sleep(0.3)
        waited = not waiting.done()
        # As in SGLang, a request waiting out the pause is not "running": a second abort pause
        # and /update_weight_version's default abort_all_requests leave it waiting.
        await client.post("/pause_generation", json={"mode": "abort"})
        await client.post("/update_weight_version", json={"new_version": "5"})
        await client.post("/continue_generation", json={})
        resumed = await (await waiting).json()
        return aborted, waited, resumed

    aborted, waited, resumed = serve(checkpoints / "a", scenario)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < 400
    assert len(aborted["meta_info"]["output_token_logprobs"]) == len(aborted["output_ids"])
    assert waited, "a request sent while paused must wait for /continue_generation"
    assert resumed["meta_info"]["weight_version"] == "5" and len(resumed["output_ids"]) == 2


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_flush_cache_waits_for_running_requests_not_for_those_held_by_a_pause(checkpoints, mode):
    """As SGLang's scheduler: /flush_cache is refused while a request decodes, but a request
    that arrived during the pause (or, under retract, one retracted) is not running, so the
    weight sync's flush after an update succeeds while it waits."""

    async def scenario(client, engine):
        running = asyncio.create_task(client.post("/generate", json=body(max_new_tokens=400)))
        while engine.running_requests == 0:
            await asyncio.sleep(0.01)
        busy = (await client.post("/flush_cache")).status
        await client.post("/pause_generation", json={"mode": mode})
        waiting = asyncio.create_task(client.post("/generate", json=body(max_new_tokens=2)))
        if mode == "abort":
            await running
        while engine.active_requests < (1 if mode == "abort" else 2):
            await asyncio.sleep(0.01)
        paused = (await client.post("/flush_cache")).status
        await client.post("/continue_generation", json={})
        await waiting
        if mode == "retract":
            await running
        return busy, paused

    busy, paused = serve(checkpoints / "a", scenario)
    assert (busy, paused) == (400, 200)


def test_concurrent_requests_are_served_together_and_abort_by_rid(checkpoints):
    async def scenario(client, engine):
        first = asyncio.create_task(client.post("/generate", json=body(400) | {"rid": "slow"}))
        second = asyncio.create_task(client.post("/generate", json=body(3) | {"rid": "quick"}))
        peak = 0
        while not second.done():
            peak = max(peak, engine.active_requests)
            await asyncio.sleep(0.005)
        quick = await (await second).json()
        await client.post("/abort_request", json={"rid": "slow"})
        slow = await (await first).json()
        return peak, quick, slow

    peak, quick, slow = serve(checkpoints / "a", scenario)
    assert peak == 2, "both requests should be in flight at once"
    assert quick["meta_info"]["finish_reason"]["type"] == "length"
    assert slow["meta_info"]["finish_reason"]["type"] == "abort"


def test_update_from_disk_serves_the_new_weights_and_bad_input_is_a_400(checkpoints):
    async def scenario(client, _engine):
        update = await client.post(
            "/update_weights_from_disk",
            json={"model_path": str(checkpoints / "b"), "weight_version": "2"},
        )
        after = await (await client.post("/generate", json=body())).json()
        expert = await client.post(
            "/get_weights_by_name",
            json={"name": "model.layers.1.mlp.experts.3.up_proj.weight", "truncate_size": 5},
        )
        errors = [
            await client.post("/generate", json={"text": "hello"}),
            await client.post("/generate", json={"input_ids": [1, 10**6]}),
            await client.post("/get_weights_by_name", json={"name": "no.such.weight"}),
            await client.post("/pause_generation", json={"mode": "sideways"}),
            await client.post(
                "/update_weights_from_distributed",
                json={"names": [], "dtypes": [], "shapes": [], "group_name": "g"},
            ),
            await client.post("/end_weight_update", json={}),
        ]
        return (
            await update.json(),
            after,
            await expert.json(),
            [(e.status, (await e.json())["error"]["message"]) for e in errors],
        )

    update, after, expert, errors = serve(checkpoints / "a", scenario)
    assert update["success"] and after["meta_info"]["weight_version"] == "2"
    engine_lp = torch.tensor([entry[0] for entry in after["meta_info"]["output_token_logprobs"]])
    reference = hf_log_probs(checkpoints / "b", PROMPT + after["output_ids"])
    assert (engine_lp - reference).abs().max() <= 1e-5
    from tiny_qwen import saved_tensors

    saved = saved_tensors(checkpoints / "b")["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert expert == saved.flatten()[:5].tolist()
    assert [status for status, _ in errors] == [400] * 6
    assert "no tokenizer" in errors[0][1] and "vocabulary" in errors[1][1]
    assert "no.such.weight" in errors[2][1] and "sideways" in errors[3][1]
    assert "between begin_weight_update() and end_weight_update()" in errors[4][1]
    assert "no weight-update session" in errors[5][1]


def test_a_weight_update_runs_while_paused_requests_hold_every_generation_thread(checkpoints):
    async def scenario(client, _engine):
        await client.post("/pause_generation", json={"mode": "in_place"})
        waiting = [asyncio.create_task(client.post("/generate", json=body(2))) for _ in range(6)]
        await asyncio.sleep(0.3)  # more waiting requests than generation threads
        update = client.post(
            "/update_weights_from_disk", json={"model_path": str(checkpoints / "b")}
        )
        answer = await asyncio.wait_for(update, timeout=30)
        await client.post("/continue_generation", json={})
        done = [await (await task).json() for task in waiting]
        return answer.status, done

    status, done = serve(checkpoints / "a", scenario, max_concurrency=2)
    assert status == 200 and all(len(d["output_ids"]) == 2 for d in done)
