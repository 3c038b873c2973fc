"""The CPU engine against hostile or broken clients, served as `engine.cpu.server.main` serves it
(real TCP, handlers not cancelled on disconnect): context-length limits, bounded bodies,
generation that stops when its client disconnects, and a 400 naming the field for every
malformed request shape."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from engine_harness import PROMPT, serving, until
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.cpu.engine import CpuEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("limits") / "tiny"
    tiny_checkpoint("qwen3_moe", directory, seed=0)  # max_position_embeddings 64
    return directory


def count_forwards(engine: CpuEngine) -> list[int]:
    calls: list[int] = []
    engine.model.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


async def send(http, url, path, body=None, raw: bytes | None = None, method="POST"):
    data = raw if raw is not None else json.dumps(body).encode()
    async with http.request(method, url + path, data=data) as response:
        text = await response.text()
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return response.status, message, text


def test_prompts_are_checked_against_the_context_length_before_any_work(model_dir):
    engine = CpuEngine(model_dir)
    assert engine.context_length == 64, "the config's max_position_embeddings"
    calls = count_forwards(engine)

    async def main():
        async with serving(engine) as (url, _), aiohttp.ClientSession() as http:
            huge = await send(http, url, "/generate", {"input_ids": [1] * 100_000})
            total = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 61}}
            over = await send(http, url, "/generate", total)
            batch = {"input_ids": [PROMPT, [1] * 64], "sampling_params": {"max_new_tokens": 1}}
            in_batch = await send(http, url, "/generate", batch)
            forwards_after_refusals = len(calls)
            fill = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": None}}
            async with http.post(url + "/generate", json=fill) as response:
                filled = await response.json()
            return huge, over, in_batch, forwards_after_refusals, filled

    huge, over, in_batch, forwards, filled = asyncio.run(main())
    assert huge[:2] == (
        400,
        "The input (100000 tokens) is longer than the model's context length (64 tokens).",
    )
    assert over[0] == 400 and "total of 65 tokens: 4 tokens from the input and 61" in over[1]
    assert in_batch[0] == 400 and "The input (64 tokens)" in in_batch[1]
    assert forwards <= 1, "a refused prompt never reaches the model (a batch sibling may)"
    assert filled["meta_info"]["completion_tokens"] == 60  # null budget: up to the context


def test_request_bodies_are_bounded(model_dir):
    engine = CpuEngine(model_dir)

    async def main():
        async with (
            serving(engine, max_request_bytes=2**20) as (url, _),
            aiohttp.ClientSession() as http,
        ):
            big = await send(http, url, "/generate", raw=b"[" + b"1," * 2**20 + b"1]")
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
            return big, await send(http, url, "/generate", body)

    big, after = asyncio.run(main())
    assert big[0] == 413 and "Maximum request body size 1048576 exceeded" in big[1]
    assert after[0] == 200


def test_disconnected_clients_stop_their_generation(model_dir):
    """32 long requests fill every generation thread; their clients leave; a short request is
    then served and no abandoned request runs on."""
    engine = CpuEngine(model_dir, context_length=20_000)
    calls = count_forwards(engine)
    long = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 19_000}}

    async def main():
        async with serving(engine, max_concurrency=32) as (url, _):
            leaving = aiohttp.ClientSession()
            tasks = [
                asyncio.create_task(leaving.post(url + "/generate", json=long)) for _ in range(32)
            ]
            await until(lambda: engine.active_requests == 32 and len(calls) > 64, "32 running")
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await leaving.close()
            async with aiohttp.ClientSession() as http:
                short = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
                status, _, text = await asyncio.wait_for(send(http, url, "/generate", short), 120)
            served_after = len(calls)
            await until(lambda: engine.active_requests == 0, "no request left")
            return status, json.loads(text), served_after, len(calls)

    status, answer, served_after, final = asyncio.run(main())
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 2
    # One abandoned request running to its end alone would take 19 000 forwards.
    assert served_after < 19_000 and final < 19_000, (served_after, final)


MALFORMED = [
    # (path, body (json) or raw bytes, fragment of the 400 message)
    ("/generate", b"[1, 2]", "the body must be a JSON object, got list"),
    ("/generate", b"input_ids=1", "the body is not JSON"),
    ("/generate", b"\xff\xfe{}", "the body is not JSON"),
    ("/generate", {}, "send exactly one of input_ids or text"),
    ("/generate", {"input_ids": [1], "text": "x"}, "exactly one of input_ids or text"),
    ("/generate", {"input_ids": "1 2 3"}, "input_ids must be a non-empty list"),
    ("/generate", {"input_ids": []}, "input_ids must be a non-empty list"),
    ("/generate", {"input_ids": [1, "2"]}, "input_ids[1] must be an int token id"),
    ("/generate", {"input_ids": [1.0]}, "input_ids[0] must be an int"),
    ("/generate", {"input_ids": [True]}, "input_ids[0] must be an int"),
    ("/generate", {"input_ids": [[1, 2], [[3]]]}, "input_ids[1][0] must be an int"),
    ("/generate", {"input_ids": [[1], 2]}, "input_ids[1] must be a non-empty list"),
    ("/generate", {"input_ids": [[1], []]}, "input_ids[1] must be a non-empty list"),
    ("/generate", {"input_ids": [-1]}, "outside the vocabulary [0, 128)"),
    ("/generate", {"input_ids": [128]}, "outside the vocabulary [0, 128)"),
    ("/generate", {"text": "hi"}, "no tokenizer: send input_ids"),
    ("/generate", {"text": 5}, "text must be a string or a non-empty list"),
    ("/generate", {"text": []}, "text must be a string or a non-empty list"),
    ("/generate", {"input_ids": [1], "prompt": "x"}, "'prompt' is not supported"),
    ("/generate", {"input_ids": [1], "stream": True}, "'stream'=True is not supported"),
    (
        "/generate",
        {
            "input_ids": [1],
            "sampling_params": {"max_new_tokens": 1},
            "return_routed_experts": True,
            "routed_experts_start_len": 2,
        },
        "routed_experts_start_len=2 must be in [0, 1]",
    ),
    ("/generate", {"input_ids": [1], "routed_experts_start_len": -1}, "must be >= 0, got -1"),
    ("/generate", {"input_ids": [1], "return_routed_experts": 1}, "must be bool"),
    ("/generate", {"input_ids": [1], "logprob_start_len": 0}, "'logprob_start_len'=0"),
    ("/generate", {"input_ids": [1], "return_logprob": "yes"}, "'return_logprob' must be bool"),
    ("/generate", {"input_ids": [1], "rid": 5}, "rid must be a string"),
    ("/generate", {"input_ids": [1], "rid": ["a"]}, "rid must be a string"),
    ("/generate", {"input_ids": [[1], [2]], "rid": ["a", "a"]}, "2 distinct ids"),
    ("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]}, "a list of 1 for a batch"),
    ("/generate", {"input_ids": [1], "sampling_params": [{}]}, "for a single prompt"),
    *[
        ("/generate", {"input_ids": [1], "sampling_params": params}, fragment)
        for params, fragment in [
            ("temperature=0", "sampling_params must be an object, got str"),
            ({"temperature": "0.5"}, "'temperature' must be float, got str"),
            ({"temperature": -0.5}, "temperature must be a non-negative finite number"),
            ({"temperature": 1e400}, "'sampling_params.temperature' must be finite"),
            ({"top_p": 0}, "top_p must be in (0, 1]"),
            ({"top_p": 1.5}, "top_p must be in (0, 1]"),
            ({"top_k": 0}, "top_k must be -1 (disable) or at least 1"),
            ({"top_k": 2.5}, "'top_k' must be int"),
            ({"max_new_tokens": -1}, "max_new_tokens must be at least 0"),
            ({"max_new_tokens": "5"}, "'max_new_tokens' must be int"),
            ({"stop_token_ids": 5}, "'stop_token_ids' must be list"),
            ({"stop_token_ids": [1.5]}, "stop_token_ids[0] must be an int"),
            ({"ignore_eos": "yes"}, "'ignore_eos' must be bool"),
            ({"sampling_seed": 2**64}, "sampling_seed must be in [-2**63, 2**63 - 1]"),
            ({"seed": 3}, "sampling field 'seed' is not supported"),
            ({"min_p": 0.1}, "'min_p'=0.1 is not supported"),
            ({"n": 2}, "'n'=2 is not supported"),
            ({"stop": ["x"]}, "'stop' is not supported"),
        ]
    ],
    ("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}', "finite"),
    ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": Infinity}}', "finite"),
    ("/pause_generation", [], "must be a JSON object"),
    ("/pause_generation", {"mode": 3}, "'mode' must be str"),
    ("/pause_generation", {"mode": "sideways"}, "'sideways'"),
    ("/abort_request", {"rid": 5}, "'rid' must be str"),
    ("/abort_request", {"abort_all": "yes"}, "'abort_all' must be bool"),
    ("/update_weight_version", {}, "missing field 'new_version'"),
    ("/update_weight_version", {"new_version": True}, "'new_version' must be str or int"),
    ("/update_weights_from_disk", {}, "missing field 'model_path'"),
    ("/update_weights_from_disk", {"model_path": 5}, "'model_path' must be str"),
    ("/update_weights_from_disk", {"model_path": "/no/such"}, "'/no/such'"),
    ("/update_weights_from_disk", {"model_path": "x", "load_format": "gguf"}, "load_format"),
    ("/update_weights_from_disk", {"model_path": "x", "weight_version": [1]}, "weight_version"),
    ("/update_weights_from_distributed", {}, "between begin_weight_update() and end_weight"),
    ("/end_weight_update", {}, "no weight-update session is open"),
    ("/begin_weight_update", {}, None),  # opens a session for the cases below
    ("/begin_weight_update", {}, "already open"),
    ("/update_weights_from_distributed", {}, "missing field 'names'"),
    *[
        ("/update_weights_from_distributed", {"group_name": "weight_update_group"} | body, frag)
        for body, frag in [
            ({"names": "x", "dtypes": [], "shapes": []}, "'names' must be list"),
            ({"names": ["x"], "dtypes": [], "shapes": []}, "must have the same length"),
            ({"names": [5], "dtypes": ["float32"], "shapes": [[1]]}, "names[0] must be a str"),
            ({"names": ["x"], "dtypes": ["int8"], "shapes": [[1]]}, "dtypes[0] must be one of"),
            ({"names": ["x"], "dtypes": ["float32"], "shapes": [[-1]]}, "shapes[0] must be"),
            ({"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}, "no weight update group"),
        ]
    ],
    ("/end_weight_update", {}, "discarded, nothing applied"),
    ("/get_weights_by_name", {}, "missing field 'name'"),
    ("/get_weights_by_name", {"name": "no.such"}, "no.such: no such tensor"),
    ("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": -1}, "truncate_size"),
    ("/init_weights_update_group", {}, "missing field 'master_address'"),
    ("/init_weights_update_group", {"master_address": 5}, "'master_address' must be str"),
    ("/destroy_weights_update_group", {"group_name": 5}, "'group_name' must be str"),
]


def test_every_malformed_request_gets_a_400_naming_the_problem(model_dir):
    engine = CpuEngine(model_dir)

    async def main():
        async with serving(engine) as (url, _), aiohttp.ClientSession() as http:
            answers = []
            for path, body, _ in MALFORMED:
                raw = body if isinstance(body, bytes) else None
                answers.append(await send(http, url, path, body, raw))
            unknown = await send(http, url, "/no_such_endpoint", {})
            wrong_method = await send(http, url, "/generate", method="GET", raw=b"")
            good = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}}
            return answers, unknown, wrong_method, await send(http, url, "/generate", good)

    answers, unknown, wrong_method, good = asyncio.run(main())
    wrong = [
        (path, body, status, message)
        for (path, body, fragment), (status, message, _) in zip(MALFORMED, answers, strict=True)
        if (status, fragment is None or fragment in message)
        != (200 if fragment is None else 400, True)
    ]
    assert not wrong, "\n".join(map(str, wrong))
    assert unknown[0] == 404 and unknown[1] == "Not Found: POST /no_such_endpoint"
    assert wrong_method[0] == 405 and wrong_method[1] == "Method Not Allowed: GET /generate"
    assert good[0] == 200 and engine.active_requests == 0


def test_a_duplicate_rid_is_refused_and_the_request_owning_it_runs_on(model_dir):
    engine = CpuEngine(model_dir, context_length=512)
    calls = count_forwards(engine)

    async def main():
        async with serving(engine) as (url, _), aiohttp.ClientSession() as http:
            body = {"input_ids": PROMPT, "rid": "x", "sampling_params": {"max_new_tokens": 400}}
            owner = asyncio.create_task(send(http, url, "/generate", body))
            await until(lambda: len(calls) > 5, "the first request running")
            duplicate = await send(http, url, "/generate", body)
            return duplicate, await owner

    duplicate, owner = asyncio.run(main())
    assert duplicate[:2] == (400, "rid 'x' is already running")
    assert (
        owner[0] == 200 and json.loads(owner[2])["meta_info"]["finish_reason"]["type"] == "length"
    )
