"""RolloutService against a real SGLang-protocol HTTP server (CpuServer around a scripted
engine) and real child processes as engines: errors are read and end the service with their
cause, failed generations back off and are counted, a dead engine is named, and close()
leaves no thread and no open loop behind."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from agent_fixtures import ScriptedEngine, build_tokenizer, serving
from engine_harness import PROMPT, StepGate, until
from engine_harness import serving as engine_serving
from stub_server import StubServer
from tiny_qwen import tiny_checkpoint
from trajectory_fixtures import single_turn_trajectory

from megatron_fr.buffer.lag_buffer import LagAwareBuffer
from megatron_fr.buffer.prompts import PromptSource
from megatron_fr.config.buffer import BufferConfig
from megatron_fr.config.rollout import EngineSettings
from megatron_fr.engine.client import RolloutClient, RolloutClientConfig, ServersUnavailable
from megatron_fr.engine.cpu.engine import CpuEngine
from megatron_fr.engine.http import MODEL_INFO_PATH, get_json, post_json
from megatron_fr.engine.launcher import ServerProcess
from megatron_fr.engine.sglang.protocol import (
    UPDATE_WEIGHT_VERSION_PATH,
    SamplingParams,
    update_weight_version_request,
)
from megatron_fr.rollout.service import Backoff, EvalSet, RolloutFailed, RolloutService
from megatron_fr.rollout.supervisor import EngineDied, EngineRefused, EngineSupervisor
from megatron_fr.utils.net import free_port

PROBLEMS = [f"p{i}" for i in range(20)]


class Producer:
    """Episodes of one generate call; the reward is 1 for even problems. `broken_after`
    makes the n-th episode raise a plain bug (not a rollout failure); the first `outage`
    eval episodes fail as when the pool cannot serve them (ServersUnavailable)."""

    pad_id = 0

    def __init__(self, tokenizer, broken_after: int | None = None, outage: int = 0) -> None:
        self.tokenizer = tokenizer
        self.train_problems = PROBLEMS
        self.eval_sets = {"small": PROBLEMS[:4]}
        self.calls = 0
        self.broken_after = broken_after
        self.outage = outage
        self.closed = False

    def sampling(self, temperature: float, top_p: float = 1.0) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=8)

    async def run(self, client: RolloutClient, problem, prompt_id, group, sampling):
        self.calls += 1
        if self.broken_after is not None and self.calls > self.broken_after:
            raise ZeroDivisionError("a bug in the reward")
        if group == "eval" and self.outage:
            self.outage -= 1
            raise ServersUnavailable("scripted outage")
        ids = self.tokenizer.encode(f"solve {problem}", add_special_tokens=False)
        rollout = await client.generate(ids, sampling)
        reward = float(int(problem[1:]) % 2 == 0)
        return single_turn_trajectory(prompt_id, rollout, reward, {"group": group})

    def close(self) -> None:
        self.closed = True


class ServerThread:
    """A CpuServer around a scripted engine, on its own loop in a thread."""

    def __init__(self, tokenizer) -> None:
        self.engine = ScriptedEngine(tokenizer, lambda conversation: "ok", weight_version="0")
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),))

    async def _serve(self) -> None:
        self.stopping = asyncio.Event()
        async with serving(self.engine) as url:
            self.url = url
            self.ready.set()
            await self.stopping.wait()

    def __enter__(self) -> ServerThread:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_service(urls, producer, engines=None, **buffer) -> RolloutService:
    config = BufferConfig(**{"capacity": 16, "batch_size": 4, "max_lag": 1, **buffer})
    engines = engines or EngineSupervisor(EngineSettings(urls=urls), [])
    buffer = LagAwareBuffer(config, PromptSource(producer.train_problems, seed=0))
    client = RolloutClientConfig(urls=urls, request_timeout_s=5, max_attempts=2)
    return RolloutService(engines, buffer, producer, client, producer.sampling(1.0))


def rollout_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rollouts"]


def test_batches_flow_and_close_leaves_nothing_behind(tokenizer):
    with ServerThread(tokenizer) as server:
        producer = Producer(tokenizer)
        service = make_service([server.url], producer)
        service.start()
        try:
            batch = service.next_batch(0)
            assert len(batch) == 4 and all(t.token_versions[-1] == 0 for t in batch)
            results = service.evaluate(
                {"small": EvalSet(PROBLEMS[:4], samples=2)}, producer.sampling(0.7), 30
            )
            assert results.accuracies == {"small": (0.5, 0.0)}  # p0, p2 of p0..p3 score 1
            assert (results.failed_episodes, results.incomplete) == (0, None)
            assert service.stats().rollouts_total >= 4
        finally:
            service.close()
    assert not rollout_threads() and service._loop.is_closed() and producer.closed
    service.close()  # twice is fine


@pytest.mark.parametrize("outage, timeout_s", [(3, 30.0), (10**9, 2.0)])
def test_failed_eval_episodes_are_retried_and_an_outage_never_scores_0(
    tokenizer, outage, timeout_s
):
    """Three failed episodes are retried and the accuracy is that of a healthy pool (p0, p2 of
    p0..p3 score 1); a pool that serves nothing by the deadline leaves no accuracy at all."""
    with ServerThread(tokenizer) as server:
        producer = Producer(tokenizer, outage=outage)
        service = make_service([server.url], producer)
        service.start()
        try:
            started = time.monotonic()
            evaluation = service.evaluate(
                {"small": EvalSet(PROBLEMS[:4], samples=1)}, producer.sampling(0.7), timeout_s
            )
            elapsed = time.monotonic() - started
            failures = service.stats().rollout_failures
        finally:
            service.close()
    if outage == 3:
        assert evaluation.accuracies == {"small": (0.5, 0.0)}
        assert (evaluation.failed_episodes, evaluation.incomplete) == (3, None)
    else:
        assert evaluation.accuracies == {} and evaluation.failed_episodes >= 4
        assert "['small'] not served within 2 s" in evaluation.incomplete
        assert "scripted outage" in evaluation.incomplete
        assert elapsed < timeout_s + 1.0
    assert failures["eval small"] == evaluation.failed_episodes


def test_a_bug_in_an_episode_ends_the_service_with_its_cause(tokenizer):
    with ServerThread(tokenizer) as server:
        service = make_service([server.url], Producer(tokenizer, broken_after=2))
        try:
            with pytest.raises(RolloutFailed, match="a bug in the reward") as error:
                service.start()  # the third episode may fail before start() returns
                for version in range(100):
                    service.next_batch(version)
                    service.set_version(version + 1)
            assert isinstance(error.value.__cause__, ZeroDivisionError)
        finally:
            service.close()
    assert not rollout_threads()


def test_failed_generations_are_counted_and_back_off(tokenizer, caplog):
    unreachable = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    service = make_service([unreachable], Producer(tokenizer), capacity=4, batch_size=1)
    caplog.set_level(logging.WARNING, logger="megatron_fr.rollout")
    service.start()
    try:
        deadline = time.monotonic() + 20
        while service.backoff.delay_s < service.backoff.max_s and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = service.stats()
    finally:
        service.close()
    assert service.backoff.delay_s == service.backoff.max_s, "no backoff after many failures"
    assert stats.rollout_failures_total >= 7  # 0.05 s doubling to 5 s takes 8 failures
    assert stats.abandoned_total == stats.rollout_failures_total
    assert stats.buffer["requeued_total"] == stats.groups_failed_total >= 7
    warnings = [r for r in caplog.records if "rollout(s) failed" in r.getMessage()]
    assert 1 <= len(warnings) <= 3, "failures are logged at most once per 10 s"


def test_backoff_doubles_to_its_cap_and_resets_on_success():
    backoff = Backoff(base_s=0.1, max_s=1.0, log_every_s=1e9)
    delays = []
    for _ in range(6):
        backoff.failed("x", RuntimeError("down"))
        delays.append(backoff.delay_s)
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    backoff.succeeded()
    assert backoff.delay_s == 0.0


def test_a_dead_engine_ends_the_service_naming_it_and_its_log(tokenizer, tmp_path: Path):
    port = free_port()
    dying = ServerProcess.start(
        [
            sys.executable,
            "-c",
            "import sys, time; print('CUDA out of memory'); "
            "sys.stdout.flush(); time.sleep(1.5); sys.exit(3)",
        ],
        "127.0.0.1",
        port,
        tmp_path,
    )
    # It never listens: its refused requests would take it out before its exit is seen.
    engines = EngineSupervisor(
        EngineSettings(watch_interval_s=0.1, failures_in_a_row=1000), [dying]
    )
    service = make_service(engines.urls, Producer(tokenizer), engines=engines)
    service.start()
    started = time.monotonic()
    try:
        with pytest.raises(RolloutFailed) as error:
            service.next_batch(0)
    finally:
        service.close()
    cause = error.value.__cause__
    assert isinstance(cause, EngineDied)
    assert f"127.0.0.1:{port}" in str(cause) and f"pid {dying.pid}" in str(cause)
    assert "exited with code 3" in str(cause) and "CUDA out of memory" in str(cause)
    assert time.monotonic() - started < 30
    assert not rollout_threads()


class StuckEvalProducer(Producer):
    """Its evaluation episodes wait, as an episode waits between attempts at a dead engine."""

    async def run(self, client: RolloutClient, problem, prompt_id, group, sampling):
        if group == "eval":
            await asyncio.sleep(3600)
        return await super().run(client, problem, prompt_id, group, sampling)


@pytest.mark.parametrize("producer_class", [Producer, StuckEvalProducer])
def test_an_engine_dying_during_an_evaluation_ends_it_at_once_naming_the_engine(
    tokenizer, tmp_path: Path, producer_class
):
    """The evaluation is under way (its requests outstanding at a server that never answers,
    or its episodes waiting) when the engine process dies: evaluate raises the engine's death
    within seconds, not at its deadline: the service's loop has stopped, so the evaluation
    either never finishes or fails with what the shutdown did to it."""
    black_hole = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    url = f"http://127.0.0.1:{black_hole.getsockname()[1]}"
    dying = ServerProcess.start(
        [sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.exit(3)"],
        "127.0.0.1",
        free_port(),
        tmp_path,
    )
    # It never listens: its refused requests would take it out before its exit is seen.
    engines = EngineSupervisor(
        EngineSettings(watch_interval_s=0.1, failures_in_a_row=1000), [dying]
    )
    producer = producer_class(tokenizer)
    service = make_service([url], producer, engines=engines)
    service.start()
    started = time.monotonic()
    try:
        with pytest.raises(RolloutFailed) as error:
            service.evaluate({"small": EvalSet(PROBLEMS[:4], 1)}, producer.sampling(1.0), 45)
    finally:
        service.close()
        black_hole.close()
    assert isinstance(error.value.__cause__, EngineDied)
    assert f"pid {dying.pid}" in str(error.value) and "exited with code 3" in str(error.value)
    assert time.monotonic() - started < 30
    assert not rollout_threads()


def test_an_engine_given_by_url_that_stops_answering_is_taken_out(tmp_path: Path):
    """Out of the pool after unreachable_after_s (recorded in faults.jsonl, the epoch moved);
    the run ends only when the pool has been empty for start_timeout_s."""
    url = f"http://127.0.0.1:{free_port()}"
    settings = EngineSettings(
        urls=[url], watch_interval_s=0.05, unreachable_after_s=0.3, start_timeout_s=1.0
    )
    supervisor = EngineSupervisor(settings, [], run_dir=tmp_path)

    async def scenario() -> str:
        with pytest.raises(EngineDied) as error:
            await asyncio.wait_for(supervisor.watch(), 10)
        return str(error.value)

    message = asyncio.run(scenario())
    assert message.startswith("no inference engine has been in the pool for 1 s")
    assert f"{url} has not answered GET /model_info for 0.3 s" in message
    assert supervisor.membership() == (1, [])
    faults = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [(f["engine"], f["event"]) for f in faults] == [(url, "out")]
    assert supervisor.stats()["engines_out_total"] == 1


def test_engines_given_by_url_are_checked_before_any_step(tmp_path: Path):
    """Adopted only once /server_info says what they are: a server that does not (a router
    answering 404), or one without routed experts when the run replays routing (SGLang
    started without --enable-return-routed-experts), is refused naming it and the remedy; one
    that never answers is waited for up to start_timeout_s, then refused."""
    sglang = {"version": "0.5.23", "tp_size": 2, "enable_return_routed_experts": False}
    routing = sglang | {"enable_return_routed_experts": True}

    def start(urls: list[str], routed: bool, timeout_s: float = 5.0) -> EngineSupervisor:
        settings = EngineSettings(urls=urls, start_timeout_s=timeout_s)
        return EngineSupervisor.start(settings, tmp_path, tmp_path, routed_experts=routed)

    with (
        StubServer({"/server_info": [(200, sglang)]}) as plain,
        StubServer({"/server_info": [(200, routing)]}) as routed,
        StubServer({"/model_info": [(200, {"model_path": "m"})]}) as router,
    ):
        assert start([plain.url], routed=False).urls == [plain.url]
        assert start([routed.url], routed=True).urls == [routed.url]
        with pytest.raises(EngineRefused) as refused:
            start([routed.url, plain.url], routed=True)
        with pytest.raises(EngineRefused, match=f"{router.url} answers 404 on GET /server_info"):
            start([router.url], routed=False)
    assert str(refused.value) == (
        f"inference engine {plain.url} refused: learner.routing_replay needs the routed experts "
        "of every position, and this sglang server runs without them (/server_info: "
        "enable_return_routed_experts is not true): start it with --enable-return-routed-experts"
    )
    silent = f"http://127.0.0.1:{free_port()}"
    began = time.monotonic()
    with pytest.raises(
        EngineRefused, match=rf"{silent}/server_info\?config_format=json: no answer"
    ):
        start([silent], routed=False, timeout_s=1.0)
    assert 0.5 <= time.monotonic() - began < 1.0 + 5.0


def test_a_wedged_engine_is_taken_out_and_rejoins_once_it_serves_the_learners_weights(
    tmp_path: Path,
):
    """A CPU engine whose decoding thread is held inside a forward step (engine_harness.
    StepGate: generation frozen, the HTTP side answering) still answers GET /model_info; after
    stalled_after_s without an answer the supervisor probes it with a 1-token request, which
    waits behind the held step, and takes it out as wedged once that probe has had no answer
    for stalled_after_s too (2 x stalled_after_s + a watch interval of its last progress); its
    request in flight ends at once, and faults.jsonl says why. Idle, it was never stalled.
    Given by URL, it is re-admitted once it answers (joining), and serves again once its
    /model_info weight_version is the one a weight sync set (SGLang's field; it has no
    /get_weight_version)."""
    tiny_checkpoint("qwen3_moe", tmp_path / "model", seed=0)
    engine = CpuEngine(tmp_path / "model", context_length=64)
    gate = StepGate(engine, {"model": tmp_path / "model"})
    stalled_s, interval_s = 2.0, 0.2
    sampling = SamplingParams(max_new_tokens=4)

    async def scenario() -> dict:
        async with engine_serving(engine) as (url, _server):
            settings = EngineSettings(
                urls=[url],
                watch_interval_s=interval_s,
                stalled_after_s=stalled_s,
                unreachable_after_s=1.0,
                start_timeout_s=60.0,
            )
            supervisor = EngineSupervisor(settings, [], run_dir=tmp_path)
            config = RolloutClientConfig(urls=[url], request_timeout_s=60, max_attempts=1)
            async with RolloutClient(config) as client:
                watch = asyncio.create_task(supervisor.watch(client))
                state = supervisor.members[url]
                await client.generate(PROMPT, sampling)
                await asyncio.sleep(stalled_s + 3 * interval_s)  # idle: never stalled
                idle_state = state.state
                gate.hold_at(gate.calls + 2)  # the second decoding step of the next request
                frozen = asyncio.create_task(client.generate(PROMPT, sampling))
                await gate.held()
                held_at = time.monotonic()
                info = await asyncio.to_thread(get_json, url, MODEL_INFO_PATH, 5.0)
                await until(lambda: state.state == "out", "the wedged engine taken out")
                out_after = time.monotonic() - held_at
                with pytest.raises(ServersUnavailable):
                    await asyncio.wait_for(frozen, 5.0)  # ended at once, not at its deadline
                gate.go()  # the step finishes; the aborted request ends there
                await until(lambda: state.state == "joining", "re-admitted by URL")
                await supervisor.synced([url], "5")  # a sync that never reached it
                unsynced = state.state
                body = update_weight_version_request("5")
                await asyncio.to_thread(post_json, url, UPDATE_WEIGHT_VERSION_PATH, body, 5.0)
                await supervisor.synced([url], "5")
                back = await client.generate(PROMPT, sampling)
                watch.cancel()
        return {
            "idle": idle_state,
            "info": info,
            "out_after": out_after,
            "unsynced": unsynced,
            "state": state.state,
            "back": back,
        }

    result = asyncio.run(scenario())
    assert result["idle"] == "serving"
    assert result["info"]["weight_version"] == "default"  # /model_info answered while frozen
    # Its last progress was the request's start, just before the hold: probed after stalled_s,
    # out once the probe had no answer for stalled_s more (plus a watch round or two).
    assert 2 * stalled_s - 0.5 <= result["out_after"] <= 2 * stalled_s + 2 * interval_s + 0.5, (
        result
    )
    assert result["unsynced"] == "joining" and result["state"] == "serving"
    assert result["back"].token_versions == ["5"] * 4
    faults = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert [f["event"] for f in faults] == ["out", "joining", "in"]
    assert faults[0]["cause"].startswith("wedged: its generate requests had no answer for")
    assert "nor a 1-token probe within 2 s" in faults[0]["cause"]
    assert "rollout.engine.stalled_after_s=2" in faults[0]["cause"]
    assert faults[2]["cause"] == "serves version 5"


def test_a_slow_engine_whose_requests_all_time_out_is_probed_and_never_taken_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """Slow is not wedged: a CPU engine 200 ms a forward step serves 3 tokens in over 0.6 s,
    and the client's request timeout is 0.5 s, so no request is ever answered and the stall
    clock runs on across the timeouts past stalled_after_s (1 s). The supervisor's 1-token
    probe is answered, so the engine stays in the pool, nothing is written to faults.jsonl,
    and the log says it is slow, not wedged."""
    tiny_checkpoint("qwen3_moe", tmp_path / "model", seed=0)
    engine = CpuEngine(tmp_path / "model", context_length=64)
    engine.model.register_forward_pre_hook(lambda _module, _args: time.sleep(0.2))
    sampling = SamplingParams(max_new_tokens=32, stop_token_ids=())

    async def scenario() -> tuple[str, float]:
        async with engine_serving(engine) as (url, _server):
            settings = EngineSettings(
                urls=[url], watch_interval_s=0.2, stalled_after_s=1.0, start_timeout_s=60.0
            )
            supervisor = EngineSupervisor(settings, [], run_dir=tmp_path)
            config = RolloutClientConfig(
                urls=[url], request_timeout_s=0.5, max_attempts=1, max_timeouts=1000
            )
            async with RolloutClient(config) as client:
                watch = asyncio.create_task(supervisor.watch(client))
                slow = asyncio.create_task(client.generate(PROMPT, sampling))
                await asyncio.sleep(6.0)
                stalled = client.stalled_s(url)
                state = supervisor.members[url].state
                slow.cancel()
                watch.cancel()
        return state, stalled

    with caplog.at_level(logging.WARNING, logger="megatron_fr.rollout"):
        state, stalled = asyncio.run(scenario())
    assert state == "serving"
    assert stalled < 1.0 + 1.0, stalled  # the probe restarted its clock
    assert not (tmp_path / "faults.jsonl").exists()
    assert "slow, not wedged" in caplog.text


def test_an_engine_taken_out_for_a_symptom_after_it_exited_is_named_as_exited(tmp_path: Path):
    """The sync check's probe (or a request) can fail on an engine that has just died before
    the watch sees the exit: the cause recorded is the exit, with the symptom after it."""
    dead = ServerProcess.start(
        [sys.executable, "-c", "import sys; sys.exit(3)"], "127.0.0.1", free_port(), tmp_path
    )
    dead.proc.wait(30)
    engines = EngineSupervisor(EngineSettings(restarts=0), [dead], run_dir=tmp_path)
    symptom = "sync check: probe failed: no answer"
    with pytest.raises(EngineDied) as died:
        asyncio.run(engines.take_out_unresponsive([dead.url], symptom))
    assert f"(pid {dead.pid}) exited with code 3 ({symptom})" in str(died.value)
    (fault,) = [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]
    assert fault["event"] == "out" and fault["cause"] == f"exited with code 3 ({symptom})"
