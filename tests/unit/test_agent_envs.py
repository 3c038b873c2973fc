"""The environments one step at a time (no engine): registry, prompt files, the python tool's
observations for good and broken calls, the math reward, ALFWorld-style actions on a locally
generated TextWorld game."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_fr.envs.alfworld import (
    AlfWorldConfig,
    AlfWorldEnvironment,
    alfworld_samples,
    parse_action,
)
from megatron_fr.envs.alfworld_games import ensure_alfworld_game
from megatron_fr.envs.datasets import BUNDLED, bundled_samples, load_samples
from megatron_fr.envs.math_env import MathEnvironment
from megatron_fr.envs.python_tool import PythonToolConfig, PythonToolEnvironment
from megatron_fr.envs.sandbox import SandboxConfig
from megatron_fr.envs.textworld_games import GameSpec, default_cache_dir, ensure_game


def call(code: str, name: str = "python") -> str:
    return (
        "<tool_call>\n" + json.dumps({"name": name, "arguments": {"code": code}}) + "\n</tool_call>"
    )


@pytest.fixture(scope="module")
def python_env():
    config = PythonToolConfig(sandbox=SandboxConfig(wall_timeout_s=1.5), max_calls_per_turn=2)
    with PythonToolEnvironment(config) as env:
        yield env


def test_bundled_datasets_are_small_and_complete() -> None:
    sizes = {name: len(bundled_samples(name)) for name in BUNDLED}
    assert sizes == {"math": 20, "python_tool": 10, "alfworld": 5}
    for sample in bundled_samples("math") + bundled_samples("python_tool"):
        assert sample["id"] and sample["problem"] and sample["answer"]
    assert all("code" in sample for sample in bundled_samples("python_tool"))


def test_prompt_files_jsonl_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"problem": "1+1", "answer": "2"}, {"id": "b", "problem": "2+2", "answer": "4"}]
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    columns = [{"id": None, **rows[0]}, rows[1]]  # a parquet column holds a null
    pq.write_table(pa.Table.from_pylist(columns), tmp_path / "p.parquet")
    expected = [{"id": "p-0", **rows[0]}, rows[1]]
    assert load_samples(tmp_path / "p.jsonl") == expected
    assert load_samples(tmp_path / "p.parquet") == expected
    assert load_samples(tmp_path / "p.jsonl", limit=1) == expected[:1]
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        load_samples(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match=r"expected a \.jsonl or \.parquet"):
        load_samples(tmp_path / "p.csv")


def test_math_episode_rewards_the_verified_answer() -> None:
    with MathEnvironment() as env:
        sample = bundled_samples("math")[0]  # 3/4 + 1/8
        episode = env.start(sample)
        assert episode.messages[-1]["content"].startswith(sample["problem"])
        right = episode.step("3/4 + 1/8 = 6/8 + 1/8, so \\boxed{0.875}")
        assert (right.reward, right.done, right.info["grade"]) == (1.0, True, "correct")
        wrong = env.start(sample).step("\\boxed{\\frac{4}{12}}")
        assert (wrong.reward, wrong.done) == (0.0, True)


def test_python_tool_runs_calls_and_grades_the_final_answer(python_env) -> None:
    sample = bundled_samples("python_tool")[6]  # 17^23 mod 1000
    episode = python_env.start(sample)
    assert episode.tools[0]["function"]["name"] == "python"
    ran = episode.step("Let me compute.\n" + call(sample["code"]))
    assert not ran.done and ran.messages == [{"role": "tool", "content": sample["answer"]}]
    answer = episode.step(f"So the answer is \\boxed{{{sample['answer']}}}.")
    assert (answer.done, answer.reward, answer.info["tool_calls"]) == (True, 1.0, 1)


@pytest.mark.parametrize(
    ("action", "observation"),
    [
        ('<tool_call>{"name": "python", "arguments": {"code": "1"</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "python", "arguments": {"code": 1}', "without </tool_call>"),
        (call("print(1)", name="bash"), "unknown tool 'bash'"),
        ('<tool_call>{"name": "python", "arguments": {"src": "x"}}</tool_call>', '"code"'),
        (call("import time\ntime.sleep(60)"), "error: timed out after 1.5 s (killed)"),
        (call("1 / 0"), "error: exit code 1"),
        (call("print(open('/etc/passwd').read())"), "PermissionError"),
        (call("print('x' * 10**6)"), "error: output exceeded"),
    ],
)
def test_python_tool_errors_are_observations(python_env, action: str, observation: str) -> None:
    result = python_env.start(bundled_samples("python_tool")[0]).step(action)
    assert not result.done and result.reward == 0.0
    (message,) = result.messages
    assert message["role"] == "tool" and observation in message["content"], message
    assert message["content"].startswith("error:")


def test_python_tool_call_limits(python_env) -> None:
    episode = python_env.start(bundled_samples("python_tool")[0])
    result = episode.step(call("print(1)") + call("print(2)") + call("print(3)"))
    assert [m["content"] for m in result.messages] == ["1", "2", "error: at most 2 calls per turn"]
    assert result.info["tool_statuses"] == ["ok", "ok", "limit"]


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("Action: go east", "go east"),
        ("I should open it.\nACTION: Open Cabinet.", "open cabinet"),
        ("> take  apple", "take apple"),
        ("thinking\n\ngo   north\n", "go north"),
        ("Action: look\nno wait\nAction: inventory", "inventory"),
        ("Action: go\x0f \x01east\x7f", "go east"),
        ("Action: \\d *o< z", "d o z"),
        ("Action: öpen été", "pen t"),
        ("", ""),
    ],
)
def test_alfworld_action_parsing(text: str, command: str) -> None:
    assert parse_action(text) == command


def by_id(env_name: str, sample_id: str) -> dict:
    return next(s for s in bundled_samples(env_name) if s["id"] == sample_id)


def test_alfworld_episode_on_a_generated_textworld_game() -> None:
    spec = by_id("alfworld", "tw-house-1")
    path = ensure_game(GameSpec(**spec), default_cache_dir())
    assert path.exists() and path.with_suffix(".json").exists()
    assert ensure_game(GameSpec(**spec), default_cache_dir()) == path, "cached"
    env = AlfWorldEnvironment()
    episode = env.start(spec)
    intro = episode.messages[-1]["content"]
    assert episode.objective in intro and "Your admissible actions are:" in intro
    assert "$$$$" not in intro, "the ASCII banner is cut"
    nonsense = episode.step("Action: dance wildly")
    assert not nonsense.done and nonsense.info["command"] == "dance wildly"
    garbage = ["\x01\x08\x0f<|im_start|>", "é" * 300, "".join(map(chr, range(128))), "\\d *o"]
    for text in garbage:  # jericho crashed on control bytes, looped forever on "\\d *o"
        assert not episode.step(f"Action: {text}").done
    empty = episode.step("   ")
    assert "Nothing happens" in empty.messages[0]["content"]
    *path_there, last = episode.walkthrough
    for command in path_there:
        step = episode.step(f"Action: {command}")
        assert not step.done and "admissible" in step.messages[0]["content"]
    won = episode.step(f"Action: {last}")
    assert (won.done, won.reward, won.info["won"]) == (True, 1.0, True)
    episode.close()


@pytest.mark.parametrize("sample_id", ["alfworld-apple-countertop", "alfworld-cool-tomato"])
def test_alfworld_real_game_from_a_bundled_problem(sample_id: str, tmp_path: Path) -> None:
    """ALFWorld's own domain, grammar and wrappers on a hand-written problem: its intro, its
    "apple 1" names, its "Nothing happens.", the planner's walkthrough wins."""
    env = AlfWorldEnvironment(AlfWorldConfig(alfworld_dir=str(tmp_path)))
    episode = env.start(by_id("alfworld", sample_id))
    intro = episode.messages[-1]["content"]
    assert intro.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert f"Your task is to: {episode.objective}" in intro
    assert "go to countertop 1" in intro and "_bar_" not in intro
    assert episode.step("Action: dance").messages[0]["content"].startswith("Nothing happens.")
    *path_there, last = episode.walkthrough
    for command in path_there:
        assert not episode.step(f"Action: {command}").done
    won = episode.step(f"Action: {last}")
    assert (won.done, won.reward) == (True, 1.0)
    episode.close()


def test_alfworlds_own_alfred_tw_env_plays_the_bundled_games(tmp_path: Path) -> None:
    """The built games are in ALFWorld's data layout: its AlfredTWEnv finds and plays them."""
    from megatron_fr.envs.alfworld_games import import_alfworld

    ensure_alfworld_game("pick_and_place_simple-Apple-None-CounterTop-1", tmp_path)
    (sample,) = alfworld_samples(tmp_path)
    assert sample["id"] == "pick_and_place_simple-Apple-None-CounterTop-1"
    alfred_tw_env = import_alfworld(tmp_path)
    config = {
        "dataset": {"eval_id_data_path": str(tmp_path), "num_eval_games": -1},
        "env": {
            "goal_desc_human_anns_prob": 0.0,
            "task_types": [1],
            "domain_randomization": False,
            "expert_type": "planner",
        },
        "general": {"training_method": "dagger"},
        "dagger": {"training": {"max_nb_steps_per_episode": 10}},
    }
    env = alfred_tw_env.AlfredTWEnv(config, train_eval="eval_in_distribution").init_env(1)
    observations, infos = env.reset()
    assert "Your task is to: put an apple in countertop." in observations[0]
    commands = [
        "go to diningtable 1",
        "take apple 1 from diningtable 1",
        "go to countertop 1",
        "move apple 1 to countertop 1",
    ]
    for command in commands:
        _, _, dones, infos = env.step([command])
    assert dones == (True,) and infos["won"] == [True]
    env.close()
