"""RolloutClient against a scripted SGLang-protocol server defined here.

The server answers /generate deterministically: output token i is (last input token + 1 + i),
every log-prob is -0.5, the weight version comes from its script (reported as SGLang's
per-token spans), and it finishes "length" at max_new_tokens (or "stop" on a stop token).
Switches make it slow, broken (malformed body, 5xx, 4xx), abort after k tokens (a pause for a
weight update, after which its version goes up) or update its weights in place mid-request.
Asked for routed experts, it answers with those of positions [routed_experts_start_len,
prompt + output - 1) (position p, layer l: experts (p + l) % 4 and (p + l + 1) % 4), encoded
by SGLang's own detokenizer function read from the installed package; an abort after 0 tokens
carries none, as SGLang's abort of a request in its waiting queue.
Run as a script (`python test_rollout_client.py --port 0 --delay S`) it serves in its own process,
printing "PORT <n>", so a test can kill it by PID mid-request.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import select
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import pytest
import torch
from aiohttp import web
from pydantic import ValidationError

from megatron_fr.engine.client import (
    RequestRejected,
    Rollout,
    RolloutClient,
    RolloutClientConfig,
    RoutedExpertsUnavailable,
    ServersUnavailable,
    TopLogProbsUnavailable,
)
from megatron_fr.engine.sglang.protocol import (
    MalformedResponse,
    RoutedExpertsLayout,
    SamplingParams,
)
from megatron_fr.engine.sglang.source import exec_function, function_source

LAYOUT = RoutedExpertsLayout(num_layers=2, top_k=2, num_experts=4)


@dataclass
class Script:
    """What the scripted server does; tests running it in-process flip these between calls."""

    version: int = 1
    delay_s: float = 0.0
    serial: bool = False
    """Serve one /generate at a time (each taking delay_s), as an engine whose service time
    grows with the requests it holds; a request whose client gave up is still served."""
    status: int | None = None
    """Answer every /generate with this HTTP status."""
    malformed: str | None = None
    """"token_id": output_token_logprobs[1][1] is wrong; "not_json": the body is not JSON;
    "too_long": one token more than max_new_tokens; "spans": the version spans miss a token;
    "top_short": output_top_logprobs misses the last token; "top_null": its first row is null
    (SGLang's row for a token it has no top-K of)."""
    abort_after: int = 0
    aborts: int = 0
    """This many times, stop after `abort_after` tokens with finish "abort" (ignoring stop
    tokens, as a pause racing a stop token would) and then bump `version`."""
    switch_after: int | None = None
    """Once: tokens from this index on come from `version` + 1 (an in-place weight update in
    the middle of the request), and the version stays there."""
    routing: str = "sglang"
    """Asked for routed experts: "sglang" answers as SGLang; "missing" sends none (a server
    without --enable-return-routed-experts); "short" one position too few."""
    log: list[dict] = field(default_factory=list)
    """Every /generate received: rid, input_ids, max_new_tokens, return_routed_experts and
    routed_experts_start_len."""


def routing_of(position: int) -> list[list[int]]:
    """The scripted router: [layer][k] experts of a position."""
    return [[(position + layer) % 4, (position + layer + 1) % 4] for layer in range(2)]


def sglang_b64(rows: list) -> str:
    """SGLang's encoding of one request's routed experts (int32 tensor -> base64 text), by
    DetokenizerManager._b64_encode_per_request from the installed sglang."""
    source = function_source(
        "srt/managers/detokenizer_manager.py", "_b64_encode_per_request", "DetokenizerManager"
    )
    encode = exec_function(source, "_b64_encode_per_request", {"pybase64": base64})
    tensor = torch.tensor(rows, dtype=torch.int32).reshape(len(rows), 2, 2)
    return encode([tensor])[0]


def _generate_body(script: Script, body: dict) -> dict:
    sampling, prompt = body["sampling_params"], body["input_ids"]
    limit, stops = sampling["max_new_tokens"], set(sampling["stop_token_ids"])
    aborting = script.aborts > 0 and script.abort_after <= limit
    count = script.abort_after if aborting else limit
    ids, finish = [], {"type": "length", "length": limit}
    for token in range(prompt[-1] + 1, prompt[-1] + 1 + count):
        ids.append(token)
        if token in stops and not aborting:
            finish = {"type": "stop", "matched": token}
            break
    if aborting:
        finish = {"type": "abort", "message": "Abort in waiting queue"}
    if script.malformed == "too_long":
        ids.append(ids[-1] + 1)
    spans = _spans(script, len(ids))
    meta = {
        "id": body.get("rid"),
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "weight_version": spans[-1]["version"],
        "weight_versions": spans,
        "output_token_logprobs": [[-0.5, token, None] for token in ids],
    }
    queued = aborting and not ids  # SGLang's waiting-queue abort: no routed experts
    if body["return_routed_experts"] and script.routing != "missing" and not queued:
        start = body["routed_experts_start_len"]
        rows = max(0, len(prompt) + len(ids) - 1 - start) - (script.routing == "short")
        meta["routed_experts"] = sglang_b64([routing_of(p) for p in range(start, start + rows)])
    k = body.get("top_logprobs_num", 0)
    if k:  # SGLang's nested output_top_logprobs: token t's top k are t, t + 1, ... (version v)
        meta["input_top_logprobs"] = []
        meta["output_top_logprobs"] = [
            [[-0.5 - j - script.version / 100, token + j, None] for j in range(k)] for token in ids
        ][: len(ids) - (script.malformed == "top_short")]
        if script.malformed == "top_null" and ids:
            meta["output_top_logprobs"][0] = None
    if script.malformed == "token_id":
        meta["output_token_logprobs"][1][1] += 1000
    if aborting:
        script.aborts -= 1
        script.version += 1
    return {"text": "", "output_ids": ids, "meta_info": meta}


def _spans(script: Script, count: int) -> list[dict]:
    """SGLang's meta_info.weight_versions for `count` tokens of the script's version(s)."""
    switch = script.switch_after
    if switch is None or not 0 < switch < count:
        return [{"version": str(script.version), "start": 0, "end": count}]
    script.switch_after, script.version = None, script.version + 1
    spans = [{"version": str(script.version - 1), "start": 0, "end": switch}]
    spans.append({"version": str(script.version), "start": switch, "end": count})
    if script.malformed == "spans":
        spans[-1]["end"] -= 1
    return spans


def scripted_app(script: Script) -> web.Application:
    serial = asyncio.Lock()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        script.log.append(
            {
                "rid": body.get("rid"),
                "input_ids": body["input_ids"],
                "max_new_tokens": body["sampling_params"]["max_new_tokens"],
                "return_routed_experts": body["return_routed_experts"],
                "routed_experts_start_len": body.get("routed_experts_start_len"),
                "top_logprobs_num": body.get("top_logprobs_num"),
            }
        )
        if script.serial:
            async with serial:
                await asyncio.sleep(script.delay_s)
        else:
            await asyncio.sleep(script.delay_s)
        if script.status is not None:
            return web.Response(status=script.status, text="scripted failure")
        if script.malformed == "not_json":
            return web.Response(text="<html>oops</html>")
        return web.json_response(_generate_body(script, body))

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def log(request: web.Request) -> web.Response:
        return web.json_response(script.log)

    app = web.Application()
    app.add_routes(
        [web.post("/generate", generate), web.get("/health", health), web.get("/_log", log)]
    )
    return app


@contextlib.asynccontextmanager
async def serving(*scripts: Script) -> AsyncIterator[list[str]]:
    """In-process scripted servers on free ports; yields their URLs."""
    runners = []
    try:
        for script in scripts:
            runner = web.AppRunner(scripted_app(script))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
        yield [f"http://127.0.0.1:{runner.addresses[0][1]}" for runner in runners]
    finally:
        for runner in runners:
            await runner.cleanup()


def _serve_forever(port: int, delay_s: float) -> None:
    async def main() -> None:
        runner = web.AppRunner(scripted_app(Script(delay_s=delay_s)))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


@pytest.fixture
def spawn_server() -> Callable[[float], tuple[subprocess.Popen, str]]:
    """Start scripted servers in their own processes; each is killed by its handle at teardown."""
    procs: list[subprocess.Popen] = []

    def spawn(delay_s: float) -> tuple[subprocess.Popen, str]:
        cmd = [sys.executable, __file__, "--port", "0", "--delay", str(delay_s)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("PORT "), f"scripted server did not start: {line!r}"
        return proc, f"http://127.0.0.1:{int(line.split()[1])}"

    yield spawn
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def config(urls: list[str], **overrides: object) -> RolloutClientConfig:
    return RolloutClientConfig(
        urls=urls, request_timeout_s=10.0, connect_timeout_s=2.0, **overrides
    )


def sampling(max_new_tokens: int = 4, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, **kwargs)


def test_concurrent_requests_spread_over_both_servers() -> None:
    a, b = Script(delay_s=0.3), Script(delay_s=0.3)

    async def body() -> list[Rollout]:
        async with serving(a, b) as urls, RolloutClient(config(urls)) as client:
            return await asyncio.gather(*(client.generate([i], sampling()) for i in range(8)))

    rollouts = asyncio.run(body())
    assert len(a.log) == len(b.log) == 4
    for i, rollout in enumerate(rollouts):
        assert rollout.output_ids == [i + 1, i + 2, i + 3, i + 4]
        assert rollout.output_logprobs == [-0.5] * 4
        assert rollout.token_versions == ["1"] * 4
        assert (rollout.finish_reason, rollout.attempts) == ("length", 1)


def test_session_sticks_to_its_server_until_that_server_fails() -> None:
    a, b = Script(), Script()

    async def body() -> None:
        async with serving(a, b) as urls, RolloutClient(config(urls, server_cooldown_s=0)) as c:
            first = await c.generate([1], sampling(), session_id="conv")
            assert first.server == urls[0]
            for _ in range(3):  # plain balancing would alternate b, a, b
                assert (await c.generate([2], sampling(), session_id="conv")).server == urls[0]
            assert (await c.generate([3], sampling())).server == urls[1]
            assert len(a.log) == 4 and len(b.log) == 1

            a.status = 503
            moved = await c.generate([4], sampling(), session_id="conv")
            assert (moved.server, moved.attempts) == (urls[1], 2)
            a.status = None
            for _ in range(3):  # b has now served more, yet the session stays there
                assert (await c.generate([5], sampling(), session_id="conv")).server == urls[1]
            c.end_session("conv")
            assert (await c.generate([6], sampling(), session_id="conv")).server == urls[0]

    asyncio.run(body())


def test_killed_server_request_completes_on_the_other(spawn_server) -> None:
    slow, url_slow = spawn_server(3.0)
    _, url_fast = spawn_server(0.0)

    async def body() -> tuple[Rollout, float, RolloutClient]:
        async with RolloutClient(config([url_slow, url_fast])) as client:
            start = time.monotonic()
            task = asyncio.create_task(client.generate([7], sampling()))
            await asyncio.sleep(0.5)
            slow.kill()  # by PID, while the request is in flight on it
            return await task, time.monotonic() - start, client

    rollout, elapsed, client = asyncio.run(body())
    assert slow.wait(timeout=10) != 0
    assert (rollout.server, rollout.attempts) == (url_fast, 2)
    assert rollout.output_ids == [8, 9, 10, 11]
    assert elapsed < 2.5, elapsed  # did not wait out the slow server
    assert client.metrics.failures[url_slow] == 1 and client.metrics.retries == 1


def test_kill_with_many_in_flight_loses_and_duplicates_nothing(spawn_server) -> None:
    victim, url_victim = spawn_server(1.5)
    _, url_other = spawn_server(1.0)
    n = 16

    async def body() -> tuple[list[Rollout], list[dict], list[dict]]:
        async with (
            RolloutClient(config([url_victim, url_other])) as client,
            aiohttp.ClientSession() as http,
        ):
            tasks = [
                asyncio.create_task(client.generate([100 * i], sampling(), rid=f"job{i}"))
                for i in range(n)
            ]
            await asyncio.sleep(0.4)
            victim_log = await (await http.get(url_victim + "/_log")).json()
            victim.kill()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            other_log = await (await http.get(url_other + "/_log")).json()
            return results, victim_log, other_log

    results, victim_log, other_log = asyncio.run(body())
    assert len(victim_log) == n // 2  # half the requests were in flight on the killed server
    assert all(isinstance(r, Rollout) for r in results), results
    assert sorted(r.rid for r in results) == sorted(f"job{i}" for i in range(n))
    for i, rollout in enumerate(results):
        assert rollout.prompt_ids == [100 * i]
        assert rollout.output_ids == [100 * i + k for k in range(1, 5)]
        assert rollout.server == url_other
    # The other server got each job exactly once: its own half first, the moved half retried.
    served = [entry["rid"].split(".")[0] for entry in other_log]
    assert sorted(served) == sorted(f"job{i}" for i in range(n))
    moved = {entry["rid"].split(".")[0] for entry in victim_log}
    assert {r.rid for r in results if r.attempts == 2} == moved


def test_malformed_response_raises_naming_server_and_field() -> None:
    a, b = Script(malformed="token_id"), Script(malformed="not_json")

    async def body() -> tuple[RolloutClient, list[str]]:
        async with serving(a, b) as urls, RolloutClient(config(urls)) as client:
            with pytest.raises(MalformedResponse) as info:
                await client.generate([1], sampling())
            assert info.value.path == "meta_info.output_token_logprobs[1][1]"
            assert f"from {urls[0]}: " in str(info.value)
            with pytest.raises(MalformedResponse, match=rf"from {urls[1]}: response: not JSON"):
                await client.generate([1], sampling())
            return client, urls

    client, urls = asyncio.run(body())
    assert len(a.log) == len(b.log) == 1  # neither was retried blindly on the other server
    assert client.metrics.failures == {urls[0]: 1, urls[1]: 1}
    assert client.metrics.retries == 0


def test_more_tokens_than_asked_for_is_malformed() -> None:
    script = Script(malformed="too_long")

    async def body() -> None:
        async with serving(script) as urls, RolloutClient(config(urls)) as client:
            with pytest.raises(MalformedResponse, match=rf"from {urls[0]}: output_ids: 5 tokens"):
                await client.generate([1], sampling(4))

    asyncio.run(body())


def test_4xx_is_not_retried() -> None:
    a, b = Script(status=400), Script()

    async def body() -> None:
        async with serving(a, b) as urls, RolloutClient(config(urls)) as client:
            with pytest.raises(
                RequestRejected, match=rf"{urls[0]} rejected /generate with HTTP 400"
            ):
                await client.generate([1], sampling())

    asyncio.run(body())
    assert len(a.log) == 1 and b.log == []


def test_5xx_is_retried_elsewhere_and_the_server_cools_down() -> None:
    a, b = Script(status=503), Script()

    async def body() -> None:
        async with serving(a, b) as urls, RolloutClient(config(urls)) as client:
            retried = await client.generate([1], sampling())
            assert (retried.server, retried.attempts) == (urls[1], 2)
            assert retried.output_ids == [2, 3, 4, 5]
            a.status = None
            # a is cooling down: the next calls go to b although b has served more.
            for _ in range(2):
                assert (await client.generate([2], sampling())).server == urls[1]
            assert client.metrics.requests == {urls[0]: 1, urls[1]: 3}
            assert client.metrics.failures == {urls[0]: 1}
            assert client.metrics.retries == 1

    asyncio.run(body())
    assert len(a.log) == 1 and len(b.log) == 3


def test_abort_is_continued_and_tokens_carry_their_version() -> None:
    script = Script(abort_after=3, aborts=1)

    async def body() -> Rollout:
        async with serving(script) as urls, RolloutClient(config(urls)) as client:
            return await client.generate([10, 20], sampling(8))

    rollout = asyncio.run(body())
    assert rollout.output_ids == list(range(21, 29))
    assert len(rollout.output_ids) == 8
    assert rollout.token_versions == ["1", "1", "1", "2", "2", "2", "2", "2"]
    assert rollout.output_logprobs == [-0.5] * 8
    assert (rollout.finish_reason, rollout.continuations, rollout.attempts) == ("length", 1, 2)
    assert rollout.prompt_ids == [10, 20]
    second = script.log[1]
    assert second["input_ids"] == [10, 20, 21, 22, 23] and second["max_new_tokens"] == 5


def test_versions_switching_inside_a_segment_and_across_an_abort_are_kept_per_token() -> None:
    """An in-place update after token 2 (two spans in one response), then an abort after
    token 5 and a continuation under the next version."""
    script = Script(switch_after=2, abort_after=5, aborts=1)

    async def body() -> Rollout:
        async with serving(script) as urls, RolloutClient(config(urls)) as client:
            return await client.generate([10], sampling(8))

    rollout = asyncio.run(body())
    assert rollout.output_ids == list(range(11, 19))
    assert rollout.token_versions == ["1", "1", "2", "2", "2", "3", "3", "3"]
    assert (rollout.finish_reason, rollout.continuations) == ("length", 1)


def test_top_logprobs_of_every_segment_follow_the_output_tokens() -> None:
    """K top log-probs asked for every segment; an abort after 3 tokens, a zero-token abort
    (SGLang's waiting queue), then the rest: one row per output token, each from the answer
    that sampled it (the scripted log-probs carry the version)."""
    script = Script(abort_after=3, aborts=1)

    async def body(script: Script) -> Rollout:
        async with serving(script) as urls, RolloutClient(config(urls, top_logprobs=2)) as client:
            return await client.generate([10, 20], sampling(6))

    rollout = asyncio.run(body(script))
    assert [entry["top_logprobs_num"] for entry in script.log] == [2, 2]
    top = rollout.top_logprobs
    assert top.ids.tolist() == [[t, t + 1] for t in range(21, 27)]
    versions = [1] * 3 + [2] * 3
    assert (
        top.log_probs.tolist()
        == np.float32([[-0.5 - v / 100, -1.5 - v / 100] for v in versions]).tolist()
    )
    waiting = Script(abort_after=0, aborts=1)
    assert asyncio.run(body(waiting)).top_logprobs.tokens == 6
    with pytest.raises(MalformedResponse, match=r"output_top_logprobs: expected 6 lists"):
        asyncio.run(body(Script(malformed="top_short")))
    with pytest.raises(TopLogProbsUnavailable, match="for the first 1 of 6 output tokens"):
        asyncio.run(body(Script(malformed="top_null")))


def test_version_spans_missing_a_token_are_malformed_and_not_retried() -> None:
    a, b = Script(switch_after=1, malformed="spans"), Script()

    async def body() -> None:
        async with serving(a, b) as urls, RolloutClient(config(urls)) as client:
            with pytest.raises(MalformedResponse) as info:
                await client.generate([1], sampling(4))
            assert info.value.path == "meta_info.weight_versions"
            assert f"from {urls[0]}: meta_info.weight_versions: cover 3 of 4" in str(info.value)

    asyncio.run(body())
    assert (len(a.log), len(b.log)) == (1, 0)


@pytest.mark.parametrize(
    ("abort_after", "aborts", "stops", "max_new", "max_cont", "expected_ids", "finish", "sent"),
    [
        (3, 1, [23], 8, 8, [21, 22, 23], "stop", 1),  # aborted right on a stop token
        (2, 1, [25], 10, 8, [21, 22, 23, 24, 25], "stop", 2),  # stop in the continued segment
        (4, 1, [], 4, 8, [21, 22, 23, 24], "length", 1),  # aborted with the budget used up
        (1, 5, [], 10, 2, [21, 22, 23], "abort", 3),  # continuations bounded
    ],
)
def test_continuation_honours_stop_length_and_bound(
    abort_after, aborts, stops, max_new, max_cont, expected_ids, finish, sent
) -> None:
    script = Script(abort_after=abort_after, aborts=aborts)

    async def body() -> Rollout:
        async with serving(script) as urls:
            client = RolloutClient(config(urls, max_continuations=max_cont))
            async with client:
                return await client.generate([20], sampling(max_new, stop_token_ids=stops))

    rollout = asyncio.run(body())
    assert (rollout.output_ids, rollout.finish_reason) == (expected_ids, finish)
    assert len(script.log) == sent == rollout.attempts
    if finish == "abort":
        assert rollout.token_versions == ["1", "2", "3"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"top_p": 0.9}, "top_p"), ({"top_k": 20}, "top_k"), ({"temperature": 0.0}, "greedy")],
)
def test_truncated_sampling_with_behavior_correction_is_refused(kwargs, match: str) -> None:
    script = Script()

    async def body() -> None:
        async with serving(script) as urls, RolloutClient(config(urls)) as client:
            with pytest.raises(ValueError, match=match):
                await client.generate([1], sampling(**kwargs), behavior_correction=True)
            await client.generate([1], sampling(**kwargs))  # fine without the correction

    asyncio.run(body())
    assert len(script.log) == 1


def test_routed_experts_of_segments_and_turns_tile_the_row_once() -> None:
    """A continuation after an abort asks from the first position not reported; a second turn
    (prompt = the first turn's row + an observation) asks from where the first turn ended; the
    records together hold every fed position of the row once, each as the server reported it."""
    script = Script(abort_after=1, aborts=1)

    async def body() -> tuple[Rollout, Rollout, Rollout]:
        async with serving(script) as urls:
            async with RolloutClient(config(urls, routed_experts=LAYOUT)) as client:
                first = await client.generate([5, 6], sampling(3))
                row = [5, 6, *first.output_ids, 40, 41]  # + an observation
                start = first.routed_experts.positions
                second = await client.generate(row, sampling(2), routed_experts_from=start)
            async with RolloutClient(config(urls)) as client:
                off = await client.generate([5, 6], sampling(3))
        return first, second, off

    first, second, off = asyncio.run(body())
    assert first.continuations == 1 and off.routed_experts is None
    # segment 1 fed [5, 6] and sampled 7 (aborted); segment 2 fed [5, 6, 7], sampled 8, 9
    assert [e["routed_experts_start_len"] for e in script.log] == [0, 2, 4, None]
    assert [e["return_routed_experts"] for e in script.log] == [True, True, True, False]
    row = [5, 6, *first.output_ids, 40, 41, *second.output_ids]
    routed = np.concatenate([first.routed_experts.experts, second.routed_experts.experts])
    assert routed.tolist() == [routing_of(p) for p in range(len(row) - 1)]
    assert routed.dtype == np.uint8 and first.routed_experts.num_experts == 4


def test_zero_token_aborts_without_routed_experts_are_continued_not_fatal() -> None:
    """Two syncs abort the request while it waits in SGLang's queue (no token, no routed
    experts), then it runs: one rollout, its routing tiling the row once."""
    script = Script(abort_after=0, aborts=2)

    async def body() -> Rollout:
        async with serving(script) as urls, RolloutClient(config(urls, routed_experts=LAYOUT)) as c:
            return await c.generate([5, 6], sampling(3))

    rollout = asyncio.run(body())
    assert (rollout.output_ids, rollout.finish_reason, rollout.continuations) == (
        [7, 8, 9],
        "length",
        2,
    )
    assert [e["routed_experts_start_len"] for e in script.log] == [0, 0, 0]
    assert rollout.routed_experts.experts.tolist() == [routing_of(p) for p in range(4)]
    assert rollout.token_versions == ["3", "3", "3"]


@pytest.mark.parametrize(
    ("routing", "error", "match"),
    [
        ("missing", RoutedExpertsUnavailable, "--enable-return-routed-experts"),
        (
            "short",
            MalformedResponse,
            r"meta_info.routed_experts: 64 bytes, expected 5 positions x 2 layers x top-2 x 4 "
            r"\(int32\) = 80",
        ),
    ],
)
def test_routed_experts_missing_or_malformed_are_refused(routing, error, match) -> None:
    script = Script(routing=routing)

    async def body() -> None:
        async with serving(script) as urls, RolloutClient(config(urls, routed_experts=LAYOUT)) as c:
            await c.generate([5, 6], sampling(4))

    with pytest.raises(error, match=match):
        asyncio.run(body())
    assert len(script.log) == 1, "not retried: the server's answer would not change"


def test_routed_experts_from_must_be_within_the_prompt() -> None:
    async def body() -> None:
        async with RolloutClient(config(["http://127.0.0.1:9"], routed_experts=LAYOUT)) as c:
            await c.generate([5, 6], sampling(4), routed_experts_from=3)

    with pytest.raises(ValueError, match=r"routed_experts_from 3 must be in \[0, 2\]"):
        asyncio.run(body())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_server_taken_out_of_the_pool_ends_its_requests_and_gets_no_more() -> None:
    """A hung server (its answer 8 s away) is taken out while a request waits on it: the
    request is retried on the other at once, with nothing lost, and nothing more goes to the
    hung one; admitted again, it serves; with no server in the pool, a call fails at once."""
    hung, healthy = Script(delay_s=8.0), Script()

    async def body() -> tuple[Rollout, float, list[str]]:
        async with serving(hung, healthy) as urls, RolloutClient(config(urls)) as client:
            start = time.monotonic()
            task = asyncio.create_task(client.generate([7], sampling()))
            await asyncio.sleep(0.5)
            assert len(hung.log) == 1 and not healthy.log  # the request waits on the hung one
            client.take_out(urls[0])
            rollout = await task
            elapsed = time.monotonic() - start
            more = await asyncio.gather(*(client.generate([i], sampling()) for i in range(4)))
            assert {r.server for r in more} == {urls[1]} and len(hung.log) == 1
            client.take_out(urls[1])
            with pytest.raises(ServersUnavailable, match="no engine in the pool"):
                await client.generate([1], sampling())
            hung.delay_s = 0.0
            client.admit(urls[0])
            assert (await client.generate([2], sampling())).server == urls[0]
            return rollout, elapsed, client.urls

    rollout, elapsed, known = asyncio.run(body())
    assert (rollout.server, rollout.attempts) == (known[1], 2)
    assert rollout.output_ids == [8, 9, 10, 11]
    assert elapsed < 4.0, elapsed  # not the hung server's 8 s, nor the request timeout


def test_failures_in_a_row_are_counted_per_server_and_reset_by_a_success() -> None:
    """What the pool's watch reads to take out an engine that keeps failing."""
    broken, healthy = Script(status=503), Script()

    async def body() -> list[int]:
        async with serving(broken, healthy) as urls:
            cfg = config(urls, server_cooldown_s=0, max_attempts=1)
            async with RolloutClient(cfg) as client:
                counts = []
                for _ in range(4):
                    with contextlib.suppress(ServersUnavailable):
                        await client.generate([1], sampling())
                counts.append(client.failing(urls[0]))
                broken.status = None
                for _ in range(2):
                    await client.generate([1], sampling())
                return [*counts, client.failing(urls[0]), client.failing(urls[1])]

    assert asyncio.run(body()) == [2, 0, 0]  # 4 calls alternate: 2 on the broken server


def test_a_server_admitted_mid_run_takes_its_share() -> None:
    first, joined = Script(delay_s=0.2), Script(delay_s=0.2)

    async def body() -> list[str]:
        async with serving(first, joined) as urls, RolloutClient(config(urls[:1])) as client:
            client.admit(urls[1])
            await asyncio.gather(*(client.generate([i], sampling()) for i in range(8)))
            return client.urls

    assert len(asyncio.run(body())) == 2
    assert len(first.log) == len(joined.log) == 4


def test_refused_server_fails_naming_the_url() -> None:
    url = f"http://127.0.0.1:{_free_port()}"

    async def body() -> None:
        async with RolloutClient(config([url], max_attempts=2)) as client:
            with pytest.raises(ServersUnavailable, match="failed 2 time") as info:
                await client.generate([1], sampling())
            assert str(info.value).count(url) == 2

    asyncio.run(body())


def test_silent_server_times_out_within_the_request_timeout() -> None:
    with socket.socket() as hole:  # accepts connections (kernel backlog), never answers
        hole.bind(("127.0.0.1", 0))
        hole.listen(8)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        cfg = RolloutClientConfig(urls=[url], request_timeout_s=0.5, max_timeouts=1)

        async def body() -> float:
            async with RolloutClient(cfg) as client:
                start = time.monotonic()
                with pytest.raises(ServersUnavailable, match=f"{url}: .*Timeout"):
                    await client.generate([1], sampling())
                return time.monotonic() - start

        elapsed = asyncio.run(body())
    assert 0.45 <= elapsed < 0.5 + 1.0, elapsed


def test_wait_healthy() -> None:
    dead = f"http://127.0.0.1:{_free_port()}"

    async def body() -> None:
        async with serving(Script(), Script()) as urls:
            async with RolloutClient(config(urls)) as client:
                await client.wait_healthy(5.0)
            async with RolloutClient(config([*urls, dead])) as client:
                start = time.monotonic()
                with pytest.raises(TimeoutError, match=rf"not healthy after 0.6 s: {dead}: ") as e:
                    await client.wait_healthy(0.6)
                assert time.monotonic() - start < 0.6 + 1.0
                assert urls[0] not in str(e.value)

    asyncio.run(body())


@pytest.mark.parametrize(
    ("urls", "match"),
    [
        ([], "urls"),
        (["localhost:30000"], r"urls\[0\] must start with http"),
        (["http://a:1", "http://a:1/"], "duplicates"),
    ],
)
def test_config_refuses_bad_urls(urls: list[str], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        RolloutClientConfig(urls=urls)
    assert RolloutClientConfig(urls=["http://h:1/"]).urls == ("http://h:1",)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="scripted SGLang-protocol server for the tests")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    _serve_forever(args.port, args.delay)


def test_timeouts_halve_the_in_flight_limit_and_do_not_count_as_failing() -> None:
    """Four requests time out together: the limit goes from 1024 to half of the 4 in flight
    (the other three were sent before it was lowered, so they lower it no further); the server
    answered nothing, yet none of it counts toward taking it out. Answers then add 1/limit."""
    slow = Script(delay_s=1.0)

    async def body() -> tuple[int, int, int, int]:
        async with serving(slow) as urls:
            cfg = RolloutClientConfig(urls=urls, request_timeout_s=0.3, max_timeouts=1)
            async with RolloutClient(cfg) as client:
                calls = (client.generate([i], sampling()) for i in range(4))
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                assert all(isinstance(o, ServersUnavailable) for o in outcomes), outcomes
                lowered = client.in_flight_limit(urls[0])
                slow.delay_s = 0.0
                for _ in range(3):  # 2 + 1/2 + 1/2.5 + 1/2.9 = 3.24
                    await client.generate([1], sampling())
                timeouts = client.metrics.timeouts[urls[0]]
                return lowered, client.in_flight_limit(urls[0]), client.failing(urls[0]), timeouts

    assert asyncio.run(body()) == (2, 3, 0, 4)


def test_an_overloaded_server_serves_every_request_under_a_lowered_limit() -> None:
    """A server serving one request at a time (0.15 s each) gets 8 at once with a 0.5 s
    timeout: those past the third time out; the limit drops and the retries, queued in the
    client, are all served there. No call fails and the server is never counted failing."""
    busy = Script(delay_s=0.15, serial=True)

    async def body() -> tuple[list[Rollout], int, int, int]:
        async with serving(busy) as urls:
            cfg = RolloutClientConfig(urls=urls, request_timeout_s=0.5, max_attempts=1)
            async with RolloutClient(cfg) as client:
                calls = (client.generate([i], sampling()) for i in range(8))
                rollouts = await asyncio.gather(*calls)
                url = urls[0]
                return rollouts, client.metrics.timeouts[url], client.failing(url), len(busy.log)

    rollouts, timeouts, failing, posts = asyncio.run(body())
    assert [r.output_ids[0] for r in rollouts] == list(range(1, 9))
    assert timeouts > 0 and failing == 0
    assert posts == 8 + timeouts  # every timed-out request was sent again, nothing else


def test_idle_connections_are_dropped_before_sglang_closes_them() -> None:
    """SGLang's HTTP server closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE
    seconds (read from the installed sglang's srt/environ.py); the client must drop an idle
    connection sooner, or a request sent on one the server closed fails ("Server
    disconnected") and counts against a healthy engine."""
    import ast

    from megatron_fr.engine import client as client_module
    from megatron_fr.engine.sglang.source import sglang_root

    tree = ast.parse((sglang_root() / "srt" / "environ.py").read_text())
    setting = next(
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "SGLANG_TIMEOUT_KEEP_ALIVE" for t in node.targets)
    )
    assert isinstance(setting, ast.Call) and isinstance(setting.args[0], ast.Constant)
    assert 0 < client_module.KEEPALIVE_S < setting.args[0].value
