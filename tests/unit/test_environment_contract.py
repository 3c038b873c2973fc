"""Every environment keeps the contract the agent loop relies on (envs/base.py), and a new one
plugs in without touching the package: by an import path in the recipe, or by an entry point
of an installed distribution (a real one, written to a directory on sys.path here).

The contract, checked on each built-in with its bundled samples:
    - Config validates the empty settings and refuses an unknown key, naming it;
    - start(sample) gives chat messages ({"role", "content": str}) and tools None or a list;
    - step(text) gives a StepResult: finite reward, a list of messages, a bool done,
      JSON-serialisable info; messages only while the episode is not done;
    - episodes and the environment close without error (also twice).
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_fr.config.run import load_run_config
from megatron_fr.envs.base import StepResult
from megatron_fr.envs.datasets import DATA_DIR, load_samples
from megatron_fr.envs.registry import (
    BUILTIN,
    UnknownEnvironment,
    build_environment,
    environment_class,
    environment_config,
    known_names,
)
from megatron_fr.orchestrator.workload import resolve_task

REPO = Path(__file__).resolve().parents[2]
SAMPLES = {
    "math": "math.jsonl",
    "python_tool": "python_tool.jsonl",
    "alfworld": "alfworld.jsonl",
    "textworld": "textworld.jsonl",
}
ACTIONS = {
    "math": "The answer is \\boxed{4}.",
    "python_tool": "I think it is \\boxed{4}.",
    "alfworld": "Action: look",
    "textworld": "Action: look",
}


def check_messages(messages: object) -> None:
    assert isinstance(messages, list)
    for message in messages:
        assert set(message) == {"role", "content"} and isinstance(message["content"], str)
        assert message["role"] in ("system", "user", "assistant", "tool")


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_environment_keeps_the_contract(name: str) -> None:
    assert set(SAMPLES) == set(BUILTIN), "a new built-in needs its row here"
    cls = environment_class(name)
    assert cls.name == name
    assert environment_config(name, {}) == cls.Config()
    with pytest.raises(ValueError, match=r"task\.env\.no_such_key"):
        environment_config(name, {"no_such_key": 1})
    sample = load_samples(DATA_DIR / SAMPLES[name])[0]
    with build_environment(name) as environment:
        episode = environment.start(sample)
        check_messages(episode.messages)
        assert (episode.messages and episode.tools is None) or isinstance(episode.tools, list)
        result = episode.step(ACTIONS[name])
        assert isinstance(result, StepResult) and isinstance(result.done, bool)
        assert math.isfinite(result.reward)
        check_messages(result.messages)
        assert not (result.done and result.messages), "a finished episode says nothing more"
        json.dumps(result.info)
        episode.close()
        episode.close()


PLUGIN = textwrap.dedent('''
    """A third-party environment: echoes the turn back; reward 1 for "yes"."""
    from typing import ClassVar

    from pydantic import BaseModel, ConfigDict

    from megatron_fr.envs.base import Environment, Episode, StepResult


    class EchoConfig(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        greeting: str = "Say yes."


    class EchoEpisode(Episode):
        def __init__(self, greeting: str) -> None:
            self.messages = [{"role": "user", "content": greeting}]

        def step(self, action: str) -> StepResult:
            return StepResult(reward=float(action.strip() == "yes"), done=True)


    class EchoEnvironment(Environment):
        name: ClassVar[str] = "echo"
        Config: ClassVar[type[BaseModel]] = EchoConfig

        def __init__(self, config: EchoConfig) -> None:
            self.config = config

        def start(self, sample) -> EchoEpisode:
            return EchoEpisode(self.config.greeting)
''')


@pytest.fixture
def plugin_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution `echo-env` installed in a directory on sys.path: its module and its
    metadata with an entry point in the group the registry reads."""
    (tmp_path / "echo_env.py").write_text(PLUGIN)
    info = tmp_path / "echo_env-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-env\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[megatron_fr.environments]\necho = echo_env:EchoEnvironment\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("echo_env", None)


def test_a_plugin_is_found_by_entry_point_and_by_import_path(plugin_on_path: Path) -> None:
    assert "echo" in known_names()
    for name in ("echo", "echo_env:EchoEnvironment"):
        with build_environment(name, {"greeting": "Say yes!"}) as environment:
            episode = environment.start({"id": "0"})
            assert episode.messages == [{"role": "user", "content": "Say yes!"}]
            assert episode.step("yes").reward == 1.0
    with pytest.raises(ValueError, match=r"task\.env\.greting"):
        build_environment("echo", {"greting": "typo"})


def test_a_recipe_names_a_plugin_and_the_run_config_resolves_it(plugin_on_path: Path) -> None:
    """The typed run config never imports environments: the recipe's task.env is validated by
    the plugin's own Config, and a one-turn environment gets the one-turn limits."""
    config = load_run_config(
        REPO / "examples" / "cpu_demo.yaml", ["task.name=echo", "task.env={greeting: hi}"]
    )
    resolved = resolve_task(config)
    assert resolved.task.env == {"greeting": "hi"}
    assert resolved.task.agent.max_turns == 1
    assert resolved.task.agent.max_episode_tokens == 128 + 24  # prompt + response budgets


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("chess", "unknown environment 'chess'"),
        ("no_such_module:Env", "cannot import 'no_such_module:Env'"),
        ("json:dumps", "is not an Environment subclass"),
    ],
)
def test_an_unknown_environment_is_refused_naming_task_name(name: str, message: str) -> None:
    with pytest.raises(UnknownEnvironment, match=message) as error:
        environment_class(name)
    assert str(error.value).startswith("task.name: ")
