"""Whatever a tool call's code holds and whatever happens when it runs, the python tool answers
with an "error:" tool message and the episode goes on to its graded answer: through the
environment's step, with the calls written as a policy writes them (JSON inside <tool_call>,
so a NUL byte arrives as the JSON escape \\u0000)."""

from __future__ import annotations

import logging

import pytest
from test_agent_envs import call
from test_sandbox_memory import HOLD_440_MB

from megatron_fr.envs.datasets import bundled_samples
from megatron_fr.envs.python_tool import PythonToolConfig, PythonToolEnvironment
from megatron_fr.envs.sandbox import SandboxError

BROKEN_CODE = {
    "a NUL byte": "print(1)\x00",
    "NUL bytes only": "\x00" * 1000,
    "a lone surrogate": "print('\ud800')",
    "16 x 440 MiB at once": HOLD_440_MB,
}


@pytest.fixture(scope="module")
def env():
    config = PythonToolConfig(max_calls_per_turn=len(BROKEN_CODE), max_calls_per_episode=8)
    with PythonToolEnvironment(config) as environment:
        yield environment


def test_python_tool_episode_goes_on_after_broken_code(env, capsys) -> None:
    sample = bundled_samples("python_tool")[6]  # 17^23 mod 1000
    episode = env.start(sample)
    broken = episode.step("Let me try.\n" + "".join(call(code) for code in BROKEN_CODE.values()))
    assert not broken.done and broken.reward == 0.0
    with capsys.disabled():
        print(f"\n{len(BROKEN_CODE)} broken calls tried in one turn:")
        for name, message in zip(BROKEN_CODE, broken.messages, strict=True):
            print(f"  {name}: {message['content'].splitlines()[0]}")
    contents = [message["content"] for message in broken.messages]
    assert all(text.startswith("error:") for text in contents), contents
    assert "source code string cannot contain null bytes" in contents[0]
    assert "source code string cannot contain null bytes" in contents[1]
    assert "surrogates not allowed" in contents[2]
    statuses = broken.info["tool_statuses"]
    memory = "memory_limit" if env.sandbox.memory_limit != "rlimits" else "error"
    assert statuses == ["error", "error", "error", memory]
    assert broken.info["sandbox"]["isolation"] == env.sandbox.isolation
    assert broken.info["sandbox"]["memory_limit"] == env.sandbox.memory_limit
    ran = episode.step(call(sample["code"]))
    assert ran.messages == [{"role": "tool", "content": sample["answer"]}]
    answer = episode.step(f"So the answer is \\boxed{{{sample['answer']}}}.")
    assert (answer.done, answer.reward, answer.info["tool_calls"]) == (True, 1.0, 5)


def test_python_tool_sandbox_failure_is_a_tool_error(env, monkeypatch, caplog) -> None:
    """The sandbox itself failing (e.g. a process that survived SIGKILL) is the machine's
    fault: logged with its traceback, and still a tool message for the policy."""

    def fail(code: str):
        raise SandboxError("sandbox processes [4242] survived SIGKILL")

    monkeypatch.setattr(env.sandbox, "run", fail)
    episode = env.start(bundled_samples("python_tool")[0])
    with caplog.at_level(logging.ERROR, logger="megatron_fr.python_tool"):
        step = episode.step(call("print(1)"))
    assert step.messages == [
        {"role": "tool", "content": "error: the tool could not run (SandboxError)"}
    ]
    assert step.info["tool_statuses"] == ["sandbox_error"] and not step.done
    assert "survived SIGKILL" in caplog.text
    assert episode.step("\\boxed{0}").done
