"""GRPO through the real loop: G = 4 rollouts per problem over a pool of two engines, one the
run starts (rollout.engine.count=1) and one given by URL behind a flaky proxy that fails every
7th /generate with HTTP 503 (and the client's retries are off, so the failure reaches the
rollout service). Both serve rollouts and take every weight sync. Every batch must hold whole
groups only, the failed groups must be discarded whole and counted (each failed rollout
abandoned, its group's other members discarded), and the advantages the learner used must be
GRPO's group formula, written out here, on the rewards of the batch."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from training_runs import records, run_megatron_fr, served_cpu_engine, train_args

from megatron_fr.utils.net import free_port

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"
G = 4


class FlakyProxy:
    """Forwards every request to `target`; /generate number 7, 14, ... answers 503 (`every`
    0: none). `pace_s` > 0 makes it a busy engine: it forwards one /generate at a time, each
    after pace_s, so a request's service time grows with the requests ahead of it while
    answers keep coming; one whose client gave up while queued is dropped (`dropped`), as an
    engine aborts a request whose client disconnected."""

    def __init__(self, target: str, every: int = 7, pace_s: float = 0.0) -> None:
        self.target, self.every, self.pace_s = target, every, pace_s
        self.generates = self.failed = self.dropped = 0
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),))

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.path == "/generate":
            self.generates += 1
            if self.every and self.generates % self.every == 0:
                self.failed += 1
                return web.Response(status=503, text="injected failure")
            if self.pace_s:
                async with self.turn:
                    if request.transport is None or request.transport.is_closing():
                        self.dropped += 1
                        return web.Response(status=499, text="client gone")
                    await asyncio.sleep(self.pace_s)
                    return await self._upstream(request, body)
        return await self._upstream(request, body)

    async def _upstream(self, request: web.Request, body: bytes) -> web.Response:
        async with self.session.request(
            request.method,
            self.target + request.path_qs,
            data=body,
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as upstream:
            return web.Response(
                status=upstream.status,
                body=await upstream.read(),
                content_type=upstream.content_type,
            )

    async def _serve(self) -> None:
        self.stopping = asyncio.Event()
        self.turn = asyncio.Lock()
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as self.session:
            app = web.Application(client_max_size=1 << 30)
            app.router.add_route("*", "/{tail:.*}", self._forward)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.ready.set()
            await self.stopping.wait()
            await runner.cleanup()

    def __enter__(self) -> FlakyProxy:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(10)


def grpo_advantages_written_out(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """(R - mean of the group) / (sample std of the group + eps), one group."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5
    return [(r - mean) / (std + eps) for r in rewards]


@pytest.mark.distributed
def test_grpo_batches_hold_whole_groups_with_their_group_advantages(tmp_path, demo_model):
    run_dir = tmp_path / "run"
    with served_cpu_engine(demo_model) as url, FlakyProxy(url) as proxy:
        settings = [
            "steps=3",
            "learner.estimator=grpo",
            f"buffer.group_size={G}",
            "buffer.batch_size=16",
            "buffer.capacity=64",
            "buffer.max_in_flight=32",
            "eval.problems=8",
            "eval.samples=1",
            "eval.every_steps=0",
            f"model.hf_dir={demo_model}",
            f"rollout.engine.urls=['http://127.0.0.1:{proxy.port}']",
            "rollout.engine.start_timeout_s=120",
            "rollout.max_attempts=1",
            "rollout.engine.count=1",
        ]
        run_megatron_fr(*train_args(RECIPE, run_dir, *settings))
        assert proxy.failed >= 1, "no failure was injected"

    config = (run_dir / "config.yaml").read_text()
    assert "policy_loss: ppo_clip" in config and "aggregation: sequence_mean" in config
    batches = records(run_dir, "batches.jsonl")
    assert [b["step"] for b in batches] == [1, 2, 3]
    for batch in batches:
        groups = defaultdict(list)
        for prompt_id, reward, advantage in zip(
            batch["prompt_ids"], batch["rewards"], batch["advantages"], strict=True
        ):
            groups[prompt_id.rsplit("#", 1)[0]].append((reward, advantage))
        assert all(len(members) == G for members in groups.values()), groups
        for members in groups.values():
            expected = grpo_advantages_written_out([reward for reward, _ in members])
            for (_, advantage), want in zip(members, expected, strict=True):
                assert abs(advantage - want) <= 1e-5, (members, expected)
    steps = records(run_dir)
    last = [s for s in steps if "reward_mean" in s][-1]
    assert last["rollout_failures_total"] >= 1 and last["groups_failed_total"] >= 1
    assert last["abandoned_total"] >= 1 and last["discarded_total"] >= 1
    # every rollout not trained is a member of a failed group: the failed one or its peers
    assert last["abandoned_total"] + last["discarded_total"] <= G * last["groups_failed_total"]
    assert "clip_fraction" in last
    # the pool: the started engine first, then the URL; the proxy's 503s counted against it
    assert last["engines_total"] == 2
    assert last["engine0_requests_total"] > 0 and last["engine0_failures_total"] == 0, last
    assert last["engine1_requests_total"] > 0 and last["engine1_failures_total"] >= 1, last
