"""Whole episodes in each environment through the real agent loop, RolloutClient and the CPU
engine's HTTP server (cpu_server.CpuServer on a local TCP port).

- Scripted (non-learned) policies, served by ScriptedEngine inside CpuServer, complete multi-
  turn episodes and earn the reward: math (one turn, verified answer), python_tool (a broken
  call -> error observation, a real call -> sandbox output, then the answer), alfworld
  (a wrong command, then the game's walkthrough, on two real ALFWorld games built from the
  bundled hand-written problems and on a locally generated TextWorld game).
  Episodes run concurrently on one client.
- The tiny random model on the real CpuEngine plays each environment too: garbage text,
  limits hit, no crash, valid rows.

Everywhere: the action mask is 1 exactly on the tokens the engine returned, and each request's
input_ids were exactly the row up to that turn.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from agent_fixtures import ScriptedEngine, build_tokenizer, chat_model_dir, serving, turn_count

from megatron_fr.buffer.trajectory import NON_POLICY_VERSION
from megatron_fr.config.tasks import AgentConfig
from megatron_fr.engine.client import RolloutClient, RolloutClientConfig
from megatron_fr.engine.sglang.protocol import SamplingParams
from megatron_fr.envs.base import Environment, Sample
from megatron_fr.envs.datasets import bundled_samples
from megatron_fr.envs.registry import build_environment
from megatron_fr.envs.textworld_games import default_cache_dir
from megatron_fr.rollout.agent import EpisodeResult, run_episode
from megatron_fr.rollout.chat import ChatFormat

TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


async def play_all(
    url: str, chat: ChatFormat, env: Environment, samples: list[Sample], config: AgentConfig
) -> list[EpisodeResult]:
    """All samples' episodes at once on one client (as rollout workers run them)."""
    sampling = SamplingParams(max_new_tokens=config.max_new_tokens_per_turn, temperature=1.0)
    async with RolloutClient(RolloutClientConfig(urls=[url], request_timeout_s=60)) as client:

        async def one(sample: Sample) -> EpisodeResult:
            episode = env.start(sample)
            try:
                return await run_episode(
                    client, chat, episode, sampling, config, sample["id"], {"env": env.name}
                )
            finally:
                episode.close()

        return await asyncio.gather(*(one(sample) for sample in samples))


def scripted(tokenizer, policy, env, samples, config=None) -> tuple[list, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, policy)

    async def main() -> list[EpisodeResult]:
        async with serving(engine) as url:
            return await play_all(url, ChatFormat(tokenizer), env, samples, config or AgentConfig())

    return asyncio.run(main()), engine


def assert_row_matches_the_engine(result: EpisodeResult, requests: dict | None = None) -> None:
    """Mask 1 exactly on each turn's returned tokens; with the scripted engine's log
    (input ids -> output ids), each turn's input was the row up to it."""
    t = result.trajectory
    assert t is not None, result.error
    expected = [False] * t.length
    for turn in result.turns:
        span = slice(turn.start, turn.start + len(turn.output_ids))
        assert t.token_ids[span].tolist() == turn.output_ids
        expected[span] = [True] * len(turn.output_ids)
        if requests is not None:
            assert requests[tuple(t.token_ids[: turn.start].tolist())] == turn.output_ids
    assert t.action_mask.tolist() == expected
    for masked, version, logprob in zip(
        t.action_mask, t.token_versions, t.behavior_log_probs, strict=True
    ):
        assert (version != NON_POLICY_VERSION) == masked
        assert masked or logprob == 0.0


def engine_log(engine: ScriptedEngine) -> dict[tuple[int, ...], list[int]]:
    return {tuple(i): o for i, o in zip(engine.inputs, engine.outputs, strict=True)}


def test_scripted_math_episodes(tokenizer) -> None:
    samples = bundled_samples("math")[:4]
    answers = {s["problem"]: s["answer"] for s in samples}

    def policy(conversation: str) -> str:
        problem = next(p for p in answers if p in conversation)
        return f"Working it out step by step.\nThe answer is \\boxed{{{answers[problem]}}}."

    with build_environment("math") as env:
        results, engine = scripted(tokenizer, policy, env, samples)
    for result in results:
        assert (result.finish, result.reward, len(result.turns)) == ("done", 1.0, 1)
        assert result.trajectory.info["steps"][0]["grade"] == "correct"
        assert result.trajectory.info["env"] == "math"
        assert_row_matches_the_engine(result, engine_log(engine))


def test_scripted_python_tool_episodes(tokenizer) -> None:
    samples = bundled_samples("python_tool")[:3]
    codes = {s["problem"]: s["code"] for s in samples}

    def policy(conversation: str) -> str:
        code = next(c for p, c in codes.items() if p in conversation)
        turn = turn_count(conversation)
        if turn == 0:  # broken JSON: the environment must answer with an error
            return 'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": \n'
        if turn == 1:
            tool = json.dumps({"name": "python", "arguments": {"code": code}})
            return f"Again, properly.\n<tool_call>\n{tool}\n</tool_call>"
        printed = TOOL_RESPONSE.findall(conversation)[-1].strip()
        return f"The program printed {printed}, so the answer is \\boxed{{{printed}}}."

    with build_environment("python_tool") as env:
        results, engine = scripted(tokenizer, policy, env, samples)
    for sample, result in zip(samples, results, strict=True):
        assert (result.finish, result.reward, len(result.turns)) == ("done", 1.0, 3)
        steps = result.trajectory.info["steps"]
        assert steps[0]["tool_statuses"] == ["malformed"] and steps[1]["tool_statuses"] == ["ok"]
        assert result.messages[3]["content"].startswith("error: <tool_call> without")
        assert result.messages[5] == {"role": "tool", "content": sample["answer"]}
        assert_row_matches_the_engine(result, engine_log(engine))


ALFWORLD_SAMPLES = ("alfworld-apple-countertop", "alfworld-cool-tomato", "tw-house-1")
"""Two real ALFWorld games (hand-written problems) and one generated TextWorld game."""


def test_scripted_alfworld_episodes(tokenizer) -> None:
    samples = [s for s in bundled_samples("alfworld") if s["id"] in ALFWORLD_SAMPLES]
    env = build_environment("alfworld", {"games_dir": str(default_cache_dir())})
    plans = {}
    for sample in samples:  # the walkthrough of each game, keyed by its objective text
        episode = env.start(sample)
        plans[episode.objective] = ["dance wildly", *episode.walkthrough]
        episode.close()

    def policy(conversation: str) -> str:
        plan = next(p for objective, p in plans.items() if objective in conversation)
        return f"I will do this next.\nAction: {plan[turn_count(conversation)]}"

    results, engine = scripted(tokenizer, policy, env, samples)
    for result in results:
        assert (result.finish, result.reward) == ("done", 1.0)
        commands = [step["command"] for step in result.trajectory.info["steps"]]
        assert commands[0] == "dance wildly" and len(result.turns) == len(commands) >= 3
        assert result.trajectory.info["steps"][-1]["won"]
        assert "Your admissible actions are:" in result.messages[3]["content"]
        assert_row_matches_the_engine(result, engine_log(engine))


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat-model"))


@pytest.mark.parametrize("env_name", ["math", "python_tool", "alfworld"])
def test_random_model_on_the_cpu_engine_survives_every_environment(
    random_model, env_name: str
) -> None:
    from megatron_fr.engine.cpu.engine import CpuEngine

    engine = CpuEngine(random_model)
    engine.weight_version = "0"
    tokenizer = engine.tokenizer
    samples = bundled_samples(env_name)
    if env_name == "alfworld":  # one real ALFWorld game, one TextWorld game
        samples = [s for s in samples if s["id"] in ALFWORLD_SAMPLES[::2]]
    samples = samples[:2]
    options = {"games_dir": str(default_cache_dir())} if env_name == "alfworld" else {}
    config = AgentConfig(max_turns=3, max_new_tokens_per_turn=24, max_episode_tokens=4096)

    async def main() -> list[EpisodeResult]:
        async with serving(engine) as url:
            with build_environment(env_name, options) as env:
                return await play_all(url, ChatFormat(tokenizer), env, samples, config)

    results = asyncio.run(main())
    for result in results:
        assert result.finish in ("done", "max_turns"), result.finish
        assert result.reward == 0.0
        assert_row_matches_the_engine(result)
        assert set(result.trajectory.token_versions.tolist()) == {NON_POLICY_VERSION, 0}
        if env_name == "alfworld":  # garbage commands: the game answers, the episode goes on
            assert (result.finish, len(result.turns)) == ("max_turns", 3)
