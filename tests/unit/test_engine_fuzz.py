"""Fuzz of the CPU engine's HTTP API, two ways, each one fat seeded test.

1. Seeded random JSON shapes, sizes and types (hypothesis: well-formed bodies, the same with one
   field mutated, any JSON, bytes, oversized prompts) against every endpoint of a server run
   as `cpu_server.main` runs it. Every answer must come within its deadline and be a 2xx or a
   4xx with a JSON reason, never a 5xx; afterwards the server is alive, idle, and still
   generates exactly what transformers computes. Two legitimate waits are kept out of reach:
   a well-formed /init_weights_update_group waits for its peers (so "master_address" is never
   sent), and a /pause_generation holds generation until /continue_generation.
2. A corpus of bad requests only (the attacks that once wedged the engine, malformed JSON,
   wrong types, huge values, NaN, negative sizes, plus seeded mutations) against a real engine
   process started by the launcher: each outcome is counted as a clear 4xx, a 5xx, a hang, a
   silent acceptance, or a closed connection (for a request stalled in its headers, the only
   answer HTTP allows), and /health and weight updates must keep answering while the slow
   attacks are pending.

What was tried is counted and printed (pytest -s shows it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import json
import os
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from random import Random
from urllib.parse import urlsplit

import pytest
import torch
from engine_harness import PROMPT, full_sequence_log_probs, hf_model, serving
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tiny_qwen import tiny_checkpoint

from megatron_fr.engine.cpu.backend import server_command as cpu_server_command
from megatron_fr.engine.cpu.engine import CpuEngine
from megatron_fr.engine.launcher import ServerProcess
from megatron_fr.engine.server_config import ServerLaunchConfig
from megatron_fr.utils.net import free_port

DEADLINE_S = 30.0
"""Per request; a request still unanswered after it counts as a hang."""
MAX_REQUEST_BYTES = 64 * 2**10
CONTEXT = 16
GET_PATHS = ["/health", "/health_generate", "/model_info", "/server_info", "/flush_cache"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-3, 200)
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
FIELD_NAMES = st.sampled_from(
    [
        "input_ids",
        "text",
        "sampling_params",
        "rid",
        "mode",
        "abort_all",
        "new_version",
        "model_path",
        "weight_version",
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "name",
        "truncate_size",
        "master_port",
        "rank_offset",
        "world_size",
        "backend",
        "load_format",
        "stream",
        "return_logprob",
        "temperature",
        "max_new_tokens",
    ]
)
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


# --- a corpus of bad requests against a real engine process -------------------------------------

LIMITS = {
    "--context-length": "16",
    "--max-request-mib": "1",
    "--max-batch-prompts": "8",
    "--read-timeout-s": "2",
    "--weight-group-timeout-s": "2",
}
"""The engine process's bounds: small, so that every attack reaches them quickly."""
GOOD = {
    "input_ids": [3, 17, 42, 5],
    "sampling_params": {"max_new_tokens": 2},
    "return_routed_experts": True,
    "routed_experts_start_len": 0,
}
CORPUS_SEED = 20_261_204


def http_request(method: str, path: str, body: bytes | object = b"", **headers: str) -> bytes:
    """One raw HTTP/1.1 request; `body` as bytes, or JSON of anything else (NaN allowed)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: engine",
        "Connection: close",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
    ]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def exchange(address, data: bytes, deadline_s: float = DEADLINE_S) -> bytes | None:
    """Send raw bytes on a fresh connection: the whole response, b"" when the server closed
    without one, None when nothing complete came within the deadline (a hang)."""
    response = b""
    with socket.create_connection(address, timeout=deadline_s) as sock:
        with contextlib.suppress(OSError):  # a server that refuses early may close first
            sock.sendall(data)
        try:
            while not _complete(response):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                response += chunk
        except TimeoutError:
            return None
        except ConnectionResetError:
            pass
    return response


def _complete(response: bytes) -> bool:
    head, separator, body = response.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    return bool(separator) and length is not None and len(body) >= int(length[1])


def outcome(response: bytes | None) -> tuple[str, str]:
    """(kind, message): "clear 4xx" (a 4xx with a JSON reason), "unclear 4xx", "5xx",
    "hang", "accepted" (2xx) or "closed" (no answer, connection closed)."""
    if response is None:
        return "hang", ""
    if not response:
        return "closed", ""
    status = int(response.split(b" ", 2)[1])
    body = response.partition(b"\r\n\r\n")[2]
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    if status >= 500:
        return "5xx", body[:200].decode(errors="replace")
    if status >= 400:
        return ("clear 4xx" if message else "unclear 4xx"), message or body[:200].decode()
    return "accepted", body[:200].decode(errors="replace")


def generate_mutations() -> list[tuple[str, object]]:
    """(field path, bad value) pairs for /generate, each one refused on its own."""
    sampling = {
        "temperature": ["0.5", -1, float("nan"), float("inf"), [1], -0.1],
        "top_p": [0, 1.5, -0.2, "1", float("-inf")],
        "top_k": [0, -2, 2.5, "3", True],
        "max_new_tokens": [-1, 10**12, "5", 1.5, [2]],
        "stop_token_ids": [5, ["a"], [1.5], {"a": 1}],
        "sampling_seed": [2**64, -(2**64), "1", 1.5],
        "ignore_eos": ["yes", 1, [True]],
        "n": [2, 0, -1],
        "min_p": [0.5, float("nan")],
        "seed": [3],
        "stop": [["x"]],
    }
    top = {
        "input_ids": [
            "1 2 3",
            [],
            [1, "2"],
            [1.5],
            [True],
            [10**30],
            [-1],
            [[1], []],
            [[[1]]],
            [1] * 16,
            {"a": 1},
        ],
        "rid": [5, ["a"], {"x": 1}],
        "return_routed_experts": [1, "yes"],
        "routed_experts_start_len": [-1, 10**9, "0", 2.5],
        "logprob_start_len": [0, 5],
        "stream": [True],
        "prompt": ["x"],
        "sampling_params": ["temperature=0", [{}], 7],
    }
    pairs = [
        (("sampling_params", name), value) for name, values in sampling.items() for value in values
    ]
    return pairs + [((name,), value) for name, values in top.items() for value in values]


def mutated(body: dict, path: tuple, value: object) -> dict:
    """`body` with the field at `path` set to `value` (an object made on the way if needed)."""
    copy = json.loads(json.dumps(body))
    target = copy
    for key in path[:-1]:
        if not isinstance(target.get(key), dict):
            target[key] = {}
        target = target[key]
    target[path[-1]] = value
    return copy


def corpus(model_dir: Path, tmp_path: Path) -> list[tuple[str, bytes, str | None]]:
    """(name, raw request, fragment the reason must hold or None): bad requests only."""
    post = functools.partial(http_request, "POST")
    fifo_shard, fifo_index = tmp_path / "fifo_shard", tmp_path / "fifo_index"
    for directory, name in (
        (fifo_shard, "model.safetensors"),
        (fifo_index, "model.safetensors.index.json"),
    ):
        directory.mkdir()
        os.mkfifo(directory / name)
    cases = [
        ("empty body", post("/generate", b""), "not JSON"),
        ("truncated JSON", post("/generate", b'{"input_ids": [1, 2'), "not JSON"),
        ("not UTF-8", post("/generate", b"\xff\xfe{}"), "not JSON"),
        ("a list body", post("/generate", b"[1, 2]"), "must be a JSON object"),
        (
            "NaN temperature",
            post("/generate", b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}'),
            "finite",
        ),
        ("no prompt", post("/generate", {}), "exactly one of input_ids or text"),
        (
            "2M prompts, scaled to the body limit",
            post("/generate", {"input_ids": [[1]] * 150_000}),
            "a batch of 150000 prompts",
        ),
        ("9 prompts", post("/generate", {"input_ids": [[1]] * 9}), "at most 8 per request"),
        (
            "a prompt over the context",
            post("/generate", {"input_ids": [1] * 100_000}),
            "The input (100000 tokens) is longer than the model's context length (16 tokens)",
        ),
        (
            "15 MiB text, scaled to the body limit",
            post("/generate", {"text": "w1 " * 300_000}),
            "characters are tokenised",
        ),
        ("9 texts", post("/generate", {"text": ["w1"] * 9}), "at most 8 per request"),
        (
            "JSON nested 5000 deep",
            post("/generate", b"[" * 5000 + b"]" * 5000),
            "nested deeper than 32 levels",
        ),
        (
            "JSON nested 40 deep",
            post("/generate", b'{"x": ' + b"[" * 40 + b"]" * 40 + b"}"),
            "nested deeper than 32 levels",
        ),
        (
            "Content-Length 99999999999",
            b"POST /generate HTTP/1.1\r\nHost: e\r\nConnection: close\r\n"
            b"Content-Length: 99999999999\r\n\r\n",
            "Maximum request body size 1048576",
        ),
        ("a body over the limit", post("/generate", b" " * (2**20 + 10)), "Maximum request"),
        ("pause sideways", post("/pause_generation", {"mode": "sideways"}), "'sideways'"),
        ("pause mode 3", post("/pause_generation", {"mode": 3}), "'mode' must be str"),
        ("abort rid 5", post("/abort_request", {"rid": 5}), "'rid' must be str"),
        ("abort_all yes", post("/abort_request", {"abort_all": "yes"}), "must be bool"),
        ("no new_version", post("/update_weight_version", {}), "missing field 'new_version'"),
        ("new_version true", post("/update_weight_version", {"new_version": True}), "str or int"),
        ("new_version list", post("/update_weight_version", {"new_version": [1]}), "str or int"),
        (
            "FIFO named model.safetensors",
            post("/update_weights_from_disk", {"model_path": str(fifo_shard)}),
            "not a regular",
        ),
        (
            "FIFO named like the index",
            post("/update_weights_from_disk", {"model_path": str(fifo_index)}),
            "not a regular",
        ),
        (
            "disk: no such path",
            post("/update_weights_from_disk", {"model_path": "/no/such"}),
            "'/no/such'",
        ),
        (
            "disk: a file",
            post("/update_weights_from_disk", {"model_path": str(model_dir / "config.json")}),
            "model_path",
        ),
        ("disk: /dev", post("/update_weights_from_disk", {"model_path": "/dev"}), "'/dev'"),
        ("disk: path 5", post("/update_weights_from_disk", {"model_path": 5}), "must be str"),
        (
            "disk: gguf",
            post(
                "/update_weights_from_disk", {"model_path": str(model_dir), "load_format": "gguf"}
            ),
            "load_format",
        ),
        (
            "bucket outside a session",
            post(
                "/update_weights_from_distributed",
                {"names": ["x"], "dtypes": ["float32"], "shapes": [[-1]]},
            ),
            "begin_weight_update",
        ),
        ("join without master", post("/init_weights_update_group", {}), "'master_address'"),
        (
            "join port x",
            post("/init_weights_update_group", {"master_address": "h", "master_port": "x"}),
            "'master_port'",
        ),
        (
            "destroy no group",
            post("/destroy_weights_update_group", {"group_name": "nope"}),
            "no weight update group 'nope'",
        ),
        ("destroy group 5", post("/destroy_weights_update_group", {"group_name": 5}), "str"),
        ("read no name", post("/get_weights_by_name", {}), "missing field 'name'"),
        ("read no such tensor", post("/get_weights_by_name", {"name": "no.such"}), "no.such"),
        (
            "read truncate -1",
            post("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": -1}),
            "truncate",
        ),
        (
            "a lone surrogate in text",
            post("/generate", b'{"text": "w1 \\ud800 w2"}'),
            "lone surrogate",
        ),
        (
            "a lone surrogate in a batch",
            post("/generate", b'{"text": ["w1", "\\udfff"]}'),
            "text[1] holds a lone surrogate",
        ),
        (
            "join world_size 2**31",
            post("/init_weights_update_group", join(world_size=2**31)),
            "world_size",
        ),
        (
            "join master 999.1.1.1",
            post("/init_weights_update_group", join(master_address="999.1.1.1")),
            "999.1.1.1",
        ),
        (
            "join master a URL",
            post("/init_weights_update_group", join(master_address="http://h:1")),
            "master_address",
        ),
        ("join port 0", post("/init_weights_update_group", join(master_port=0)), "master_port"),
        (
            "join rank_offset = world_size",
            post("/init_weights_update_group", join(rank_offset=2)),
            "rank_offset",
        ),
        (
            "join rank_offset 0",
            post("/init_weights_update_group", join(rank_offset=0)),
            "rank_offset",
        ),
        ("join backend mpi", post("/init_weights_update_group", join(backend="mpi")), "'mpi'"),
        (
            "join group_name empty",
            post("/init_weights_update_group", join(group_name="")),
            "group_name",
        ),
        (
            "a 600 KiB weight version, scaled to the body limit",
            post("/update_weight_version", {"new_version": "v" * 600_000}),
            "'new_version' has 600000 characters",
        ),
        (
            "a lone surrogate as the version",
            post("/update_weight_version", b'{"new_version": "\\ud800"}'),
            "lone surrogate",
        ),
        (
            "150k stop_token_ids, scaled to the body limit",
            post("/generate", mutated(GOOD, ("sampling_params", "stop_token_ids"), [1] * 150_000)),
            "stop_token_ids has 150000 ids",
        ),
        ("a deflate bomb", compressed("deflate", 256 * 2**20), "inflates past 1048576 bytes"),
        ("a gzip bomb", compressed("gzip", 64 * 2**20), "inflates past 1048576 bytes"),
        ("brotli", compressed("br", 16), "Content-Encoding 'br'"),
        ("deflate cut short", compressed("deflate", 4096, cut=4), "cut short"),
        (
            "deflate of garbage",
            post("/generate", b"\x78\x9c" + bytes(range(200)), Content_Encoding="deflate"),
            "not a valid stream",
        ),
        ("unknown path", post("/nope", {}), "Not Found"),
        ("OpenAI path", post("/v1/completions", {}), "Not Found"),
        ("GET /generate", http_request("GET", "/generate"), "Method Not Allowed"),
    ]
    for path, value in generate_mutations():
        name = f"generate {'.'.join(path)}={value!r:.40}"
        cases.append((name, post("/generate", mutated(GOOD, path, value)), None))
    random = Random(CORPUS_SEED)
    text = json.dumps(GOOD).encode()
    for draw in range(15):  # seeded: a valid body cut short, and several fields spoilt at once
        cases.append(
            (f"cut at {draw}", post("/generate", text[: random.randrange(len(text))]), "not JSON")
        )
        spoilt = dict(GOOD)
        for path, value in random.sample(generate_mutations(), random.randint(2, 4)):
            spoilt = mutated(spoilt, path, value)
        cases.append((f"spoilt {draw}", post("/generate", spoilt), None))
    return cases


def join(**change: object) -> dict:
    """A well-formed /init_weights_update_group body with `change` made (port 1: nothing the
    test runs listens there)."""
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "g",
        "backend": "gloo",
    }
    return body | change


def compressed(encoding: str, inflated_bytes: int, cut: int = 0) -> bytes:
    """A /generate request whose body inflates to `inflated_bytes` of JSON spaces, in
    `encoding`, with its last `cut` bytes left out."""
    import zlib

    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS, "br": zlib.MAX_WBITS}
    packer = zlib.compressobj(9, wbits=wbits[encoding])
    body = packer.compress(json.dumps(GOOD).encode() + b" " * inflated_bytes) + packer.flush()
    body = body[: len(body) - cut]
    return http_request("POST", "/generate", body, Content_Encoding=encoding)


def health_during(address, request: bytes, probing_s: float = 1.5) -> list[float]:
    """Seconds each GET /health took while `request` was sent and answered (probed for
    `probing_s` from its sending)."""
    took = []
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(exchange, address, request)
        end = time.monotonic() + probing_s
        while time.monotonic() < end:
            start = time.monotonic()
            assert outcome(exchange(address, http_request("GET", "/health"), 5.0))[0] == "accepted"
            took.append(time.monotonic() - start)
            time.sleep(0.02)
        assert "inflates past" in outcome(sent.result())[1]
    return took


def word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer of 62 entries (ids below the tiny model's 128), so the engine
    serves text prompts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>", *(f"w{i}" for i in range(60))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>"
    )
    wrapped.save_pretrained(directory)


def slow_attacks(address, dead_master: int) -> dict[str, Callable[[], bytes | None]]:
    """The requests that used to hold the engine: a body that stops half-way, headers that
    stop half-way, and joins of a weight group whose master accepts and never answers."""
    half_body = b'POST /generate HTTP/1.1\r\nHost: e\r\nContent-Length: 100\r\n\r\n{"input'
    join = {
        "master_address": "127.0.0.1",
        "master_port": dead_master,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
    }
    attacks = {
        "half-sent body": lambda: exchange(address, half_body),
        "half-sent headers": lambda: exchange(address, b"POST /generate HTTP/1.1\r\nHost: e"),
    }
    for i in range(4):
        body = json.dumps(join | {"group_name": f"dead{i}"}).encode()
        request = http_request("POST", "/init_weights_update_group", body)
        attacks[f"join {i} to a silent master"] = lambda request=request: exchange(address, request)
    return attacks


EXPECTED = {
    "half-sent body": ("clear 4xx", "did not arrive within 2 s"),
    "half-sent headers": ("closed", ""),
}
"""What a slow attack must get (the joins: a clear 4xx naming the timeout)."""


def test_a_real_engine_refuses_a_corpus_of_bad_requests_and_keeps_answering(tmp_path):
    model_dir = tmp_path / "model"
    tiny_checkpoint("qwen3_moe", model_dir, seed=0)
    word_tokenizer(model_dir)
    port = free_port()
    launch = ServerLaunchConfig(
        model_path=str(model_dir),
        port=port,
        engine="cpu",
        return_routed_experts=True,
        log_dir=tmp_path,
    )
    limits = [arg for pair in LIMITS.items() for arg in pair]
    command = cpu_server_command(launch, has_cuda=lambda: False) + limits
    server = ServerProcess.start(command, "127.0.0.1", port, tmp_path)
    dead_master = socket.socket()  # accepts connections (kernel backlog), never answers
    dead_master.bind(("127.0.0.1", 0))
    dead_master.listen(8)
    address, outcomes, wrong = ("127.0.0.1", port), Counter(), []
    try:
        server.wait_healthy(deadline_s=120)
        for name, request, fragment in corpus(model_dir, tmp_path):
            kind, message = outcome(exchange(address, request))
            outcomes[kind] += 1
            if kind != "clear 4xx" or (fragment and fragment not in message):
                wrong.append(f"{name}: {kind} {message!r:.300}")
        with ThreadPoolExecutor(8) as pool:
            attacks = slow_attacks(address, dead_master.getsockname()[1])
            pending = {name: pool.submit(attack) for name, attack in attacks.items()}
            time.sleep(0.5)  # every attack sent and waiting
            version = {"new_version": "v2", "abort_all_requests": False}
            requests = (
                http_request("GET", "/health"),
                http_request("POST", "/update_weight_version", version),
            )
            alive = [outcome(exchange(address, request, deadline_s=2.0)) for request in requests]
            slow = {name: outcome(future.result()) for name, future in pending.items()}
        for name, (kind, message) in slow.items():
            outcomes[kind] += 1
            expected, fragment = EXPECTED.get(name, ("clear 4xx", "no answer within 2 s"))
            if kind != expected or fragment not in message:
                wrong.append(f"{name}: {kind} {message!r:.300}")
        bomb_health = health_during(address, compressed("deflate", 256 * 2**20))
        good = outcome(exchange(address, http_request("POST", "/generate", GOOD)))
        gzipped = outcome(exchange(address, compressed("gzip", 1000)))
        by_text = {"text": "w1 w2 w3", "sampling_params": {"max_new_tokens": 2}}
        text = outcome(exchange(address, http_request("POST", "/generate", by_text)))
        answer = json.loads(
            exchange(address, http_request("POST", "/generate", GOOD)).partition(b"\r\n\r\n")[2]
        )
        still_running = server.proc.poll() is None
    finally:
        dead_master.close()
        server.stop(timeout_s=10)
    print(f"\nbad requests to a real engine process ({sum(outcomes.values())}):")
    for kind, count in sorted(outcomes.items()):
        print(f"  {kind}: {count}")
    assert not wrong, "\n".join(wrong)
    assert sum(outcomes.values()) >= 60 and set(outcomes) <= {"clear 4xx", "closed"}
    assert alive == [("accepted", ""), ("accepted", '{"success": true, "message": "v2"}')]
    assert good[0] == text[0] == gzipped[0] == "accepted" and still_running
    slowest = max(bomb_health)
    print(f"  /health during a deflate bomb: {len(bomb_health)} probes, slowest {slowest:.3f} s")
    assert slowest < 0.5, "the bomb was inflated on the event loop"
    assert answer["meta_info"]["weight_version"] == "v2" and answer["meta_info"]["routed_experts"]
