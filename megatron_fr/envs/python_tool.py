"""The "python_tool" environment: the policy may run Python in the sandbox before answering.

    policy turn with <tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>
      ─► each call runs in the sandbox ─► one "tool" message per call: stdout (+ stderr), or
         "error: <why>" (malformed call, unknown tool, timeout, memory, output cap, ...)
    policy turn without a tool call ─► its final answer is graded (math_grader); done

Whatever a call's code holds (NUL bytes, lone surrogates, 100 kB of junk) and whatever goes
wrong running it, even the sandbox failing, becomes a "tool" message starting with "error:"
and the episode goes on: a step never raises because of the policy's text. A sandbox failure
is also logged with its traceback (it is the machine's fault, not the policy's). Each tool
step's info says how isolated the calls were: info["sandbox"] = {"isolation", "memory_limit",
"weaker": [reasons]} (empty "weaker" for namespaces + a cgroup; SANDBOX.md).

Samples: {"id", "problem", "answer"} like "math" (data/python_tool.jsonl is bundled; its rows
also carry a reference "code" that computes the answer, which the tests run).
"""

from __future__ import annotations

import logging
from typing import ClassVar

from pydantic import BaseModel, Field, PositiveInt

from megatron_fr.config.base import StrictModel
from megatron_fr.config.tasks import AgentConfig
from megatron_fr.envs.base import Environment, Episode, Sample, StepResult
from megatron_fr.envs.math_env import math_messages
from megatron_fr.envs.math_grader import MathGrader, MathGraderConfig
from megatron_fr.envs.sandbox import Sandbox, SandboxConfig, SandboxResult
from megatron_fr.envs.tool_calls import MalformedToolCall, ToolCall, parse_tool_calls

log = logging.getLogger("megatron_fr.python_tool")

TOOL_NAME = "python"
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Run a Python 3 program (standard library only, no network, no files "
        "outside its working directory) and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The program."}},
            "required": ["code"],
        },
    },
}
DEFAULT_SYSTEM = (
    "You are a helpful assistant. You can run Python by calling the python tool; use print() "
    "to see results. When you know the answer, reply without a tool call and put the final "
    "answer within \\boxed{}."
)


class PythonToolConfig(StrictModel):
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    grader: MathGraderConfig = Field(default_factory=MathGraderConfig)
    system_prompt: str = DEFAULT_SYSTEM
    instruction: str = "Use the python tool if it helps."
    max_calls_per_turn: PositiveInt = 4
    """Calls beyond this in one turn are answered with an error, not run."""
    max_calls_per_episode: PositiveInt = 8
    max_observation_chars: PositiveInt = 2000
    """Each tool message is cut to this many characters (the head and the tail are kept)."""


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}\n...[{len(text) - limit} characters cut]...\n{text[-(limit - head) :]}"


class PythonToolEpisode(Episode):
    def __init__(self, env: PythonToolEnvironment, sample: Sample) -> None:
        cfg = env.config
        self.tools = [PYTHON_TOOL]
        self.messages = math_messages(sample, cfg.system_prompt, cfg.instruction)
        self._env = env
        self._answer = str(sample["answer"])
        self._calls = 0

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action)
        if not calls:
            grade = self._env.grader.grade(action, self._answer)
            info = {"grade": grade.status, "answer": grade.answer, "tool_calls": self._calls}
            return StepResult(reward=grade.reward, done=True, info=info)
        cfg = self._env.config
        outputs: list[str] = []
        statuses: list[str] = []
        for index, call in enumerate(calls):
            if index >= cfg.max_calls_per_turn:
                text, status = f"error: at most {cfg.max_calls_per_turn} calls per turn", "limit"
            elif self._calls >= cfg.max_calls_per_episode:
                text, status = "error: no tool calls left; give your final answer", "limit"
            else:
                self._calls += 1
                text, status = self._call(call)
            outputs.append(_clip(text, cfg.max_observation_chars))
            statuses.append(status)
        messages = [{"role": "tool", "content": text} for text in outputs]
        return StepResult(
            messages=messages, info={"tool_statuses": statuses, "sandbox": self._env.sandbox_report}
        )

    def _call(self, call: ToolCall | MalformedToolCall) -> tuple[str, str]:
        """(tool message, status) for one call."""
        if isinstance(call, MalformedToolCall):
            return f"error: {call.error}", "malformed"
        if call.name != TOOL_NAME:
            return f"error: unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}", "unknown"
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return 'error: the python tool needs a string argument "code"', "bad_arguments"
        try:
            result = self._env.sandbox.run(code)
        except ValueError as error:  # code over the size limit
            return f"error: {error}", "bad_arguments"
        except Exception as error:  # anything: the episode must go on (module docstring)
            log.exception("the sandbox failed on a tool call")
            return f"error: the tool could not run ({type(error).__name__})", "sandbox_error"
        return self._describe(result), result.status

    def _describe(self, result: SandboxResult) -> str:
        output = "\n".join(part.rstrip("\n") for part in (result.stdout, result.stderr) if part)
        if not result.tool_error:
            return output if output.strip() else "(no output)"
        return f"error: {result.describe(self._env.config.sandbox)}\n{output}".rstrip()


class PythonToolEnvironment(Environment):
    name: ClassVar[str] = "python_tool"
    Config: ClassVar[type[BaseModel]] = PythonToolConfig
    agent: ClassVar[AgentConfig | None] = AgentConfig()

    def __init__(self, config: PythonToolConfig | None = None) -> None:
        self.config = config or PythonToolConfig()
        self.sandbox = Sandbox(self.config.sandbox)
        self.grader = MathGrader(self.config.grader)

    @property
    def sandbox_report(self) -> dict[str, object]:
        """How isolated the calls are, for each tool step's info (module docstring)."""
        isolation: str  # the sandbox's Isolation, or "unavailable"
        try:
            isolation, weaker = self.sandbox.isolation, self.sandbox.weaknesses
        except Exception as error:  # the calls said so already: never fail the step for it
            isolation, weaker = "unavailable", [f"the sandbox could not be built: {error}"]
        return {"isolation": isolation, "memory_limit": self.sandbox.memory_limit, "weaker": weaker}

    def start(self, sample: Sample) -> PythonToolEpisode:
        return PythonToolEpisode(self, sample)

    def close(self) -> None:
        self.grader.close()
