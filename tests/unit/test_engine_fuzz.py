"""Fuzz of the CPU engine's HTTP API: seeded random JSON shapes, sizes and types (hypothesis:
well-formed bodies, the same with one field mutated, any JSON, bytes, oversized prompts)
against every endpoint of a server run as `cpu_server.main` runs it. Every answer must come
within its deadline and be a 2xx or a 4xx with a JSON reason, never a 5xx; afterwards the
server is alive, idle, and still generates exactly what transformers computes. What was tried
is counted and printed (pytest -s shows it).

Two legitimate waits are kept out of reach: a well-formed /init_weights_update_group waits for
its peers (so "master_address" is never sent), and a /pause_generation holds generation until
/continue_generation (sent after each pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
from collections import Counter
from urllib.parse import urlsplit

import pytest
import torch
from engine_harness import PROMPT, full_sequence_log_probs, hf_model, serving
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.cpu_engine import CpuEngine

DEADLINE_S = 30.0
"""Per request; a request still unanswered after it counts as a hang."""
MAX_REQUEST_BYTES = 64 * 2**10
CONTEXT = 16
GET_PATHS = ["/health", "/health_generate", "/model_info", "/get_weight_version", "/flush_cache"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 200)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
FIELD_NAMES = st.sampled_from(
    ["input_ids", "text", "sampling_params", "rid", "mode", "abort_all", "new_version",
     "model_path", "weight_version", "names", "dtypes", "shapes", "group_name", "name",
     "truncate_size", "master_port", "rank_offset", "world_size", "backend", "load_format",
     "stream", "return_logprob", "temperature", "max_new_tokens"]
)  # fmt: skip
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(FIELD_NAMES | st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _retyped(value: object, how: int) -> object:
    """The same value in another JSON type: ints as floats, as strings, as bools, or wrapped
    in a list (recursively inside lists)."""
    if isinstance(value, list):
        return [_retyped(item, how) for item in value]
    if how == 3:
        return [value]
    if isinstance(value, int) and not isinstance(value, bool):
        return (float(value), str(value), bool(value))[how]
    return value


valid_sampling = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(0, 4) | st.none()},  # SGLang's default 128 > CONTEXT
    optional={
        "temperature": st.sampled_from([0.0, 1e-7, 0.6, 1.0, 2.0]),
        "top_p": st.floats(0.05, 1.0),
        "top_k": st.sampled_from([-1, 1, 2, 50, 10**9]),
        "stop_token_ids": st.lists(st.integers(0, 127), max_size=3),
        "ignore_eos": st.booleans(),
        "sampling_seed": st.integers(-(2**63), 2**63 - 1),
        "skip_special_tokens": st.booleans(),
        "n": st.just(1),
    },
)
valid_prompt = st.lists(st.integers(0, 127), min_size=1, max_size=CONTEXT - 9)
versions = st.text(max_size=4) | st.integers(0, 9)
BODIES = {
    "/generate": st.fixed_dictionaries(
        {
            "input_ids": valid_prompt | st.lists(valid_prompt, min_size=1, max_size=3),
            "sampling_params": valid_sampling,
        },
        optional={"return_logprob": st.booleans(), "rid": st.text(min_size=1, max_size=8)},
    ),
    "/pause_generation": {"mode": st.sampled_from(["abort", "retract", "in_place"])},
    "/continue_generation": {},
    "/flush_cache": {},
    "/abort_request": {"rid": st.text(max_size=4), "abort_all": st.booleans()},
    "/init_weights_update_group": {
        "master_port": st.integers(0, 70_000),
        "rank_offset": st.integers(-1, 3),
        "world_size": st.integers(-1, 4),
        "group_name": st.text(max_size=4),
        "backend": st.sampled_from(["gloo", "nccl", "mpi"]),
    },
    "/begin_weight_update": {},
    "/end_weight_update": {},
    "/update_weights_from_distributed": {
        "names": st.lists(st.sampled_from(["lm_head.weight", "x"]), max_size=3),
        "dtypes": st.lists(st.sampled_from(["float32", "bfloat16", "int8"]), max_size=3),
        "shapes": st.lists(st.lists(st.integers(-1, 200), max_size=3), max_size=3),
        "group_name": st.sampled_from(["weight_update_group", "g"]),
        "weight_version": versions,
        "abort_all_requests": st.booleans(),
    },
    "/update_weights_from_disk": {
        "model_path": st.sampled_from(["/nonexistent", ""]) | st.text(max_size=8),
        "weight_version": versions,
        "load_format": st.sampled_from(["auto", "gguf"]),
        "abort_all_requests": st.booleans(),
    },
    "/update_weight_version": {"new_version": versions, "abort_all_requests": st.booleans()},
    "/destroy_weights_update_group": {"group_name": st.text(max_size=4)},
    "/get_weights_by_name": {
        "name": st.sampled_from(["lm_head.weight", "nope"]),
        "truncate_size": st.integers(-2, 10**6),
    },
}
"""Each endpoint's bodies of the right shape (edge values included)."""
POST_PATHS = sorted(BODIES)


def _leaves(value: object, path: tuple = ()) -> list[tuple]:
    """Every position in a JSON value (the value itself included), as key paths."""
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else []
    )
    return [path, *[leaf for key, item in items for leaf in _leaves(item, (*path, key))]]


def _replaced(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


def _mutations(body: object) -> st.SearchStrategy:
    """`body` with one position replaced: by its value in another JSON type, or by any JSON."""

    def at(path: tuple) -> st.SearchStrategy:
        old = body
        for key in path:
            old = old[key]
        retyped = st.integers(0, 3).map(lambda how: _retyped(old, how))
        return (retyped | json_values).map(lambda new: _replaced(body, path, new))

    return st.sampled_from(_leaves(body)).flatmap(at)


def _body(path: str) -> st.SearchStrategy:
    """Right-shaped bodies, mostly with one mutation; any JSON; bytes."""
    shaped = BODIES[path]
    if isinstance(shaped, dict):
        shaped = st.fixed_dictionaries({}, optional=shaped)
    mutated = shaped.flatmap(_mutations)
    bodies = st.one_of(shaped, mutated, mutated, mutated, json_values)
    return bodies.map(json.dumps) | st.binary(max_size=48)


big_prompts = (
    st.sampled_from([CONTEXT - 1, CONTEXT, 1_000, 100_000]) | st.integers(1, 40_000)
).map(lambda n: json.dumps({"input_ids": [1] * n, "sampling_params": {"max_new_tokens": 1}}))
CASES = [
    *[("POST", path, _body(path)) for path in POST_PATHS],
    ("POST", "/generate", _body("/generate")),
    ("POST", "/generate", big_prompts),
    *[("GET", path, st.just("")) for path in [*GET_PATHS, "/generate", "/nope"]],
    *[("POST", path, st.just("{}")) for path in ["/nope", "/health", "/v1/completions"]],
]
"""(method, path, body strategy); each gets EXAMPLES_PER_CASE draws of its own."""
EXAMPLES_PER_CASE = 24
SEED = 20_240_611


@contextlib.contextmanager
def server_in_thread(engine: CpuEngine):
    """The engine served on a free port by an event loop of its own; yields (host, port)."""
    loop, ready, stop = asyncio.new_event_loop(), threading.Event(), asyncio.Event()
    where: dict = {}

    async def main() -> None:
        async with serving(engine, max_request_bytes=MAX_REQUEST_BYTES) as (url, _server):
            where["url"] = url
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(60), "the server did not start"
    try:
        parts = urlsplit(where["url"])
        yield parts.hostname, parts.port
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


def call(address, method: str, path: str, body: str | bytes) -> tuple[int, bytes]:
    """One request on its own connection; a timeout (a hang) raises."""
    connection = http.client.HTTPConnection(*address, timeout=DEADLINE_S)
    try:
        data = body.encode() if isinstance(body, str) else body
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz") / "tiny"
    tiny_checkpoint("qwen3_moe", directory, seed=0)
    return directory


def test_fuzzed_requests_never_get_a_5xx_or_hang(model_dir):
    engine = CpuEngine(model_dir, context_length=CONTEXT)
    tried: Counter[tuple[str, str, int]] = Counter()
    problems: list[str] = []

    def send(method: str, path: str, body: str | bytes) -> None:
        if any("no answer" in problem for problem in problems):
            return  # the server hangs: the test has failed, no need to wait on every request
        if path == "/init_weights_update_group" and isinstance(body, str):
            parsed = json.loads(body)
            if isinstance(parsed, dict):  # never a well-formed init: it would wait for peers
                body = json.dumps({k: v for k, v in parsed.items() if k != "master_address"})
        try:
            status, raw = call(address, method, path, body)
        except OSError as error:  # the deadline passed (or the server died)
            problems.append(f"{method} {path} {body!r:.200} -> no answer: {error}")
            return
        tried[(method, path, status)] += 1
        plain_refusal = path == "/flush_cache" and status == 400  # SGLang's, in plain text
        if status >= 500 or (status >= 400 and not plain_refusal and b'"error"' not in raw):
            problems.append(f"{method} {path} {body!r:.200} -> {status} {raw[:200]!r}")
        if path == "/pause_generation":
            call(address, "POST", "/continue_generation", "{}")

    def sender(method: str, path: str):
        return lambda body: send(method, path, body)

    with server_in_thread(engine) as address:
        for case, (method, path, bodies) in enumerate(CASES):
            fuzz = settings(
                max_examples=EXAMPLES_PER_CASE,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )(given(bodies)(sender(method, path)))
            seed(SEED + case)(fuzz)()  # the same requests on every run
        print("\nfuzzed requests (method, path, status): count")
        for key, count in sorted(tried.items()):
            print(f"  {key}: {count}")
        call(address, "POST", "/continue_generation", "{}")
        alive = call(address, "GET", "/health", "")
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        status, raw = call(address, "POST", "/generate", json.dumps(body))

    assert not problems, "\n".join(problems)
    assert sum(tried.values()) >= 200 and alive[0] == 200 and engine.active_requests == 0
    generated = tried[("POST", "/generate", 200)]
    assert generated >= 10, f"only {generated} fuzzed generations succeeded"
    assert {status for (_, _, status) in tried} >= {200, 400, 404, 405, 413}
    assert status == 200
    answer = json.loads(raw)
    ids = answer["output_ids"]
    model = hf_model(model_dir)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    assert ids == logits.argmax(-1).tolist(), "greedy tokens are transformers' argmax"
    engine_lp = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    reference = full_sequence_log_probs(model, PROMPT, ids)
    assert (engine_lp - reference).abs().max() <= 1e-5
