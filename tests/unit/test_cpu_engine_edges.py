"""The CPU engine's edges, against one real engine process on a tiny model (started once for
the module, as `python -m megatron_fr.engine.cpu.server` runs):

- what SGLang 0.5.23 refuses in a body is refused with a 400 naming the field, and what it
  accepts is accepted (each accepting test cites the SGLang source line that decides it; the
  source is installed in .venv under site-packages/sglang);
- a weight-group join whose master never answers is answered within --weight-group-timeout-s;
- a /generate whose answer would carry more log-probs than --max-request-logprobs is refused
  at admission, and /health stays fast while the largest admitted one runs;
- a client that hangs up stops its generation, every prompt of it, queued ones included.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from engine_harness import PROMPT, full_sequence_log_probs, hf_model
from tiny_qwen import tiny_checkpoint

from megatron_fr.config.weights import WeightSyncConfig
from megatron_fr.engine.cpu.engine import Output
from megatron_fr.engine.cpu.server import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_LOGPROBS,
    _parser,
)
from megatron_fr.engine.cpu.wire import (
    BadRequest,
    PromptLimits,
    answer_json,
    generate_response,
    parse_generate,
)
from megatron_fr.engine.launcher import ServerProcess
from megatron_fr.utils.net import free_port

CONTEXT = 8192
"""The engine's --context-length (the tiny model's rotary embeddings extend past its 64)."""
BUDGET = 131_072
"""The engine's --max-request-logprobs: 16 prompts x 63 tokens x (1 + top-128) fit in it."""
JOIN_BOUND_S = 2
HEALTH_LIMIT_S = 1.0
"""The slowest GET /health allowed while the largest admitted request runs: 7.9 s was seen
before the budget, under a request it now refuses; 0.07 to 0.37 s here on a 2-core machine
whose load average was 16 (the margin is for such machines)."""
WORDS = ["<unk>", "<eos>", *(f"w{i}" for i in range(60))]


@dataclass
class Engine:
    url: str
    pid: int
    model_dir: Path


def word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer within the tiny model's 128 ids, so the engine serves text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )
    tokenizer.save_pretrained(directory)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    root = tmp_path_factory.mktemp("edges")
    model_dir = root / "model"
    tiny_checkpoint("qwen3_moe", model_dir, seed=0)
    word_tokenizer(model_dir)
    port = free_port()
    command = [sys.executable, "-m", "megatron_fr.engine.cpu.server"]
    command += ["--model-path", str(model_dir), "--port", str(port), "--threads", "1"]
    command += ["--context-length", str(CONTEXT), "--max-request-logprobs", str(BUDGET)]
    command += ["--weight-group-timeout-s", str(JOIN_BOUND_S)]
    server = ServerProcess.start(command, "127.0.0.1", port, root)
    try:
        server.wait_healthy(deadline_s=180)
        yield Engine(server.url, server.pid, model_dir)
    finally:
        server.stop(timeout_s=10)


def post(engine: Engine, path: str, body: object, timeout_s: float = 60) -> tuple[int, object]:
    """(status, the answer's JSON, or the error's message); `body` as bytes or as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        engine.url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["error"]["message"]


def health_s(engine: Engine) -> float:
    start = time.monotonic()
    with urllib.request.urlopen(engine.url + "/health", timeout=30) as response:
        assert response.status == 200
    return time.monotonic() - start


def generating(engine: Engine) -> bool:
    """Whether any request holds decoding state: /flush_cache refuses then, as SGLang's."""
    request = urllib.request.Request(engine.url + "/flush_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30):
            return False
    except urllib.error.HTTPError as error:
        assert error.code == 400
        return True


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used (/proc/PID/stat, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for(condition, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s  # hang guard only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def generate(prompts=1, tokens=8, top=0, **sampling) -> dict:
    params = {"max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": 0, **sampling}
    ids = PROMPT if prompts == 1 else [PROMPT] * prompts
    return {"input_ids": ids, "sampling_params": params, "top_logprobs_num": top}


# --- (a) what SGLang refuses is refused, what it accepts accepted --------------------------

GOOD = json.dumps(generate()).encode()
REFUSED = [
    # (case, path, body as bytes or JSON, fragment of the one-line 400 message)
    ("a UTF-8 byte order mark", "/generate", b"\xef\xbb\xbf" + GOOD, "byte order mark"),
    (
        "a temperature past the largest double",
        "/generate",
        b'{"input_ids": [3], "sampling_params": {"temperature": 1' + b"0" * 400 + b".5}}",
        "field 'sampling_params.temperature' must be finite, got inf",
    ),
    (
        "an integer temperature of 100k digits",
        "/generate",
        b'{"input_ids": [3], "sampling_params": {"temperature": ' + b"7" * 100_000 + b"}}",
        "field 'sampling_params.temperature' must be finite, got inf",
    ),
    (
        "NaN",
        "/generate",
        b'{"input_ids": [3], "sampling_params": {"temperature": NaN}}',
        "field 'sampling_params.temperature' must be finite, got nan",
    ),
    (
        "-Infinity in a batch's second sampling_params",
        "/generate",
        b'{"input_ids": [[3], [4]], "sampling_params": [{}, {"top_p": -Infinity}]}',
        "field 'sampling_params[1].top_p' must be finite, got -inf",
    ),
    ("a UTF-16 body", "/generate", json.dumps(generate()).encode("utf-16"), "not UTF-8"),
    (
        "a lone surrogate in rid",
        "/generate",
        b'{"input_ids": [3], "rid": "a\\udc00"}',
        "rid holds a lone surrogate",
    ),
    ("a pause whose rid is no string", "/pause_generation", {"rid": 5}, "'rid' must be str"),
    ("a pause of no known mode", "/pause_generation", {"mode": "sideways"}, "'sideways'"),
    (
        "a continue whose torch_empty_cache is no bool",
        "/continue_generation",
        {"torch_empty_cache": "yes"},
        "'torch_empty_cache' must be bool",
    ),
]


@pytest.mark.parametrize(("case", "path", "body", "fragment"), REFUSED, ids=[c[0] for c in REFUSED])
def test_what_sglang_refuses_is_a_400_naming_the_field(engine, case, path, body, fragment):
    """SGLang reads bodies with orjson (srt/entrypoints/http_server.py:480, ORJSONRequest),
    which refuses a BOM, NaN / Infinity, a number past a double and a lone surrogate; FastAPI
    turns that into its validation error, which SGLang answers 400 (http_server.py:635). The
    pause and continue bodies are validated against PauseGenerationReqInput /
    ContinueGenerationReqInput (srt/managers/io_struct.py:1927, 1949; BaseReq's rid: a
    string), also a 400."""
    status, message = post(engine, path, body)
    assert status == 400, (case, status, message)
    assert isinstance(message, str) and fragment in message and "\n" not in message, message


def test_max_new_tokens_minus_zero_is_zero_tokens(engine):
    """JSON's -0 is the integer 0 to orjson (http_server.py:480), SamplingParams.verify refuses
    only max_new_tokens < 0 (srt/sampling/sampling_params.py:286), and 0 is a prefill-only
    request (srt/managers/schedule_batch.py:1506, is_prefill_only): no token."""
    raw = b'{"input_ids": [3, 17, 42, 5], "sampling_params": {"max_new_tokens": -0}}'
    status, answer = post(engine, "/generate", raw)
    assert status == 200, answer
    assert answer["output_ids"] == [] and answer["meta_info"]["completion_tokens"] == 0


def test_temperature_minus_zero_is_greedy(engine):
    """SamplingParams.__post_init__ takes 0 <= temperature < 1e-6 as greedy
    (srt/sampling/sampling_params.py:245; -0.0 == 0), and verify refuses only temperature <
    0.0 (line 255), which -0.0 is not: the tokens are transformers' argmax, step by step."""
    raw = (
        b'{"input_ids": [3, 17, 42, 5], "sampling_params": '
        b'{"temperature": -0.0, "max_new_tokens": 6, "ignore_eos": true}}'
    )
    status, answer = post(engine, "/generate", raw)
    assert status == 200, answer
    ids = answer["output_ids"]
    with torch.no_grad():
        logits = hf_model(engine.model_dir)(torch.tensor([PROMPT + ids])).logits[0]
    assert len(ids) == 6 and ids == logits[len(PROMPT) - 1 : -1].argmax(-1).tolist()


def test_a_temperature_of_100k_digits_samples_at_the_double_it_rounds_to(engine):
    """orjson (http_server.py:480) reads a decimal of any length as the nearest double, which
    the contract (api/v1/api_types.py: _expect_float) and verify (sampling_params.py:255)
    accept: the log-probs reported are those of logits / 0.7777777777777778."""
    digits = b"0." + b"7" * 100_000
    raw = (
        b'{"input_ids": [3, 17, 42, 5], "sampling_params": {"temperature": ' + digits + b", "
        b'"max_new_tokens": 6, "ignore_eos": true, "sampling_seed": 3}}'
    )
    status, answer = post(engine, "/generate", raw)
    assert status == 200, answer
    ids = answer["output_ids"]
    engine_lp = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    reference = full_sequence_log_probs(hf_model(engine.model_dir), PROMPT, ids, float(digits))
    assert len(ids) == 6 and (engine_lp - reference).abs().max() <= 1e-4


def test_a_nul_in_text_is_a_character_like_any(engine):
    """SGLang's tokenizer manager hands text to the tokenizer with no check of its characters
    (srt/managers/tokenizer_manager.py:1020, _tokenize_texts), and orjson reads \\u0000 as a
    character: the prompt is the tokenizer's own encoding of the text."""
    from transformers import AutoTokenizer

    text = "w1 \x00 w2"
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    status, answer = post(engine, "/generate", body)
    assert status == 200, answer
    expected = len(AutoTokenizer.from_pretrained(engine.model_dir).encode(text))
    assert answer["meta_info"]["prompt_tokens"] == expected == 3  # the NUL: one unknown word


def test_unknown_fields_of_a_pause_are_ignored_and_it_pauses(engine):
    """The pause and continue bodies are validated by a schema that ignores names it does not
    have (srt/utils/msgspec_utils.py:98, extra_behavior="ignore", for every BaseReq such as
    PauseGenerationReqInput): the pause is taken, and holds a request until the continue."""
    status, answer = post(engine, "/pause_generation", {"mode": "in_place", "bogus": [1]})
    assert status == 200, answer
    held: dict = {}
    waiting = threading.Thread(
        target=lambda: held.update(out=post(engine, "/generate", generate()))
    )
    waiting.start()
    time.sleep(0.5)
    still_held = waiting.is_alive()
    status, answer = post(engine, "/continue_generation", {"also_unknown": {"x": 1}})
    waiting.join(timeout=60)
    assert status == 200, answer
    assert still_held and held["out"][0] == 200 and len(held["out"][1]["output_ids"]) == 8


# --- (b) a bounded weight-group join --------------------------------------------------------


def test_a_join_whose_master_never_answers_is_answered_within_the_bound(engine):
    silent = socket.socket()  # the kernel accepts its connections; nothing ever answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    join = {
        "master_address": "127.0.0.1",
        "master_port": silent.getsockname()[1],
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "edges_silent",
        "backend": "gloo",
    }
    answer: dict = {}
    try:
        start = time.monotonic()
        joining = threading.Thread(
            target=lambda: answer.update(out=post(engine, "/init_weights_update_group", join))
        )
        joining.start()
        time.sleep(0.3)
        health = health_s(engine)
        joining.join(timeout=60)
        took = time.monotonic() - start
    finally:
        silent.close()
    status, message = answer["out"]
    assert status == 400 and message == (
        f"joining edges_silent with master 127.0.0.1:{join['master_port']}: no answer within "
        f"{JOIN_BOUND_S} s (--weight-group-timeout-s)"
    )
    assert JOIN_BOUND_S <= took < JOIN_BOUND_S + 3, took
    assert health < HEALTH_LIMIT_S


def test_the_default_join_bound_ends_before_the_learner_gives_up():
    """An engine started with defaults answers a join it cannot complete (60 s) before the
    learner's own deadline for that call (weights.timeout_s), so the learner reports the
    engine's reason."""
    assert _parser().parse_args(["--model-path", "m"]).weight_group_timeout_s == 60
    assert WeightSyncConfig().timeout_s > DEFAULT_JOIN_TIMEOUT_S


# --- (c) a log-prob budget at admission -----------------------------------------------------


def test_a_request_past_the_log_prob_budget_is_refused_at_admission(engine):
    """1024 prompts x 4000 tokens x top-128 (no answer in 150 s before, /health at 7.9 s):
    refused at once, naming the budget and the flag that raises it; one prompt more than the
    largest admitted batch is refused too."""
    start = time.monotonic()
    status, message = post(engine, "/generate", generate(prompts=1024, tokens=4000, top=128))
    took = time.monotonic() - start
    assert status == 400 and took < 5 and "\n" not in message
    assert "may generate 4096000 tokens (1024 prompts) carrying 528384000 log-probs" in message
    assert f"budget of {BUDGET} per request" in message and "--max-request-logprobs" in message
    status, message = post(engine, "/generate", generate(prompts=17, tokens=63, top=128))
    assert status == 400 and "carrying 138159 log-probs" in message
    assert health_s(engine) < HEALTH_LIMIT_S


@pytest.mark.parametrize(
    ("prompts", "tokens"),
    [(16, 63), (1016, 1)],
    ids=["16 prompts x 63 tokens x top-128", "1016 prompts x 1 token x top-128"],
)
def test_health_stays_fast_under_the_largest_admitted_load(engine, prompts, tokens):
    assert prompts * tokens * (1 + 128) <= BUDGET < (prompts + 1) * tokens * (1 + 128)
    answer: dict = {}
    body = generate(prompts=prompts, tokens=tokens, top=128)
    sending = threading.Thread(target=lambda: answer.update(out=post(engine, "/generate", body)))
    sending.start()
    probes = []
    while sending.is_alive():
        probes.append(health_s(engine))
        time.sleep(0.02)
    sending.join()
    status, answers = answer["out"]
    assert status == 200, answers
    assert len(probes) >= 5 and max(probes) < HEALTH_LIMIT_S, sorted(probes)[-5:]
    assert len(answers) == prompts
    for one in answers:
        meta = one["meta_info"]
        assert len(one["output_ids"]) == tokens == len(meta["output_top_logprobs"])
        for (logprob, token, _), row in zip(
            meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True
        ):
            values = [entry[0] for entry in row]
            assert len(row) == 128 and values == sorted(values, reverse=True)
            assert logprob == dict((entry[1], entry[0]) for entry in row).get(token, logprob)
    print(f"\n{prompts} x {tokens} x top-128: {len(probes)} /health, slowest {max(probes):.3f} s")


def test_the_default_budget_refuses_the_measured_load_and_admits_a_long_top_k_episode():
    """Without the flag: the 1024 x 4000 x top-128 request is refused; one 32k-token episode
    with top-63 log-probs (32768 x 64 log-probs) fits exactly."""
    limits = PromptLimits.of(None, 40_000, 1024)
    assert limits.max_request_logprobs == DEFAULT_MAX_REQUEST_LOGPROBS == 2**21
    with pytest.raises(BadRequest, match="528384000 log-probs"):
        parse_generate(generate(prompts=1024, tokens=4000, top=128), limits)
    jobs, _ = parse_generate(generate(tokens=32768, top=63), limits)
    with pytest.raises(BadRequest, match="2097216 log-probs"):
        parse_generate(generate(tokens=32769, top=63), limits)
    assert len(jobs) == 1


def test_an_answer_written_entry_by_entry_is_json_dumps_text():
    """answer_json writes what json.dumps writes, -inf and NaN log-probs included."""
    output = Output([5, 7, 9], [-0.5, float("-inf"), -1e-300], {"type": "length"}, "v1", 4)
    output.top_logprobs = [
        ([-0.1, -2.5], [5, 1]),
        ([-1e-7, float("nan")], [2, 7]),
        ([0.0, -3.0], [9, 0]),
    ]
    output.routed_experts = torch.arange(12, dtype=torch.int32).reshape(3, 2, 2)
    aborted = Output([], [], {"type": "abort"}, "v1", 4, [], waiting_abort=True)
    aborted.top_logprobs = []
    for answer in ([output, aborted], [output]):
        plain = [generate_response(one, f"r{i}", None) for i, one in enumerate(answer)]
        fast = [generate_response(one, f"r{i}", None, as_json=True) for i, one in enumerate(answer)]
        assert answer_json(fast) == json.dumps(plain).encode()
        assert answer_json(fast[0]) == json.dumps(plain[0]).encode()


# --- (d) a client that hangs up stops its generation --------------------------------------


def hang_up_after_admission(engine: Engine, bodies: list[dict]) -> float:
    """Send each body on its own connection, wait until the engine generates, close them all;
    the seconds the engine takes to hold no decoding state after that."""
    connections = []
    for body in bodies:
        data = json.dumps(body).encode()
        connection = socket.create_connection(("127.0.0.1", int(engine.url.rsplit(":", 1)[1])))
        head = "POST /generate HTTP/1.1\r\nHost: e\r\nContent-Type: application/json\r\n"
        connection.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
        connections.append(connection)
    wait_for(lambda: generating(engine), "generation to start")
    time.sleep(0.3)
    for connection in connections:
        connection.close()
    start = time.monotonic()
    wait_for(lambda: not generating(engine), "generation to stop", timeout_s=30)
    return time.monotonic() - start


def assert_idle(engine: Engine) -> None:
    """Nothing starts afterwards (the queued prompts were dropped) and the process rests."""
    before = cpu_seconds(engine.pid)
    time.sleep(1.0)
    used = cpu_seconds(engine.pid) - before
    assert not generating(engine) and used < 0.25, f"{used:.2f} s of CPU in 1 s"


def test_a_batch_whose_client_hangs_up_stops_every_prompt(engine):
    """48 prompts x 2000 tokens: 32 decoding on the engine's threads, 16 queued behind them."""
    took = hang_up_after_admission(engine, [generate(prompts=48, tokens=2000)])
    assert took < 2, took
    assert_idle(engine)


def test_twenty_clients_that_hang_up_stop_generating(engine):
    took = hang_up_after_admission(
        engine, [generate(tokens=4000, sampling_seed=i) for i in range(20)]
    )
    assert took < 2, took
    assert_idle(engine)
