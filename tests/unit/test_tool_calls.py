"""Qwen-style tool-call parsing: well-formed calls come out as ToolCall, every broken one as a
MalformedToolCall with a reason, and nothing raises (random text included)."""

from __future__ import annotations

import random

import pytest

from megatron_fr.envs.tool_calls import (
    MalformedToolCall,
    ToolCall,
    parse_tool_calls,
)

CODE = {"name": "python", "arguments": {"code": "print(1)"}}

WELL_FORMED = [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>', [CODE]),
    ('I will compute.<tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call>'
     " Done.", [CODE]),
    ('<tool_call>```json\n{"name": "python", "arguments": {"code": "print(1)"}}\n```</tool_call>',
     [CODE]),
    ('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>',
     [CODE]),
    ('<tool_call>{"name": "now"}</tool_call>', [{"name": "now", "arguments": {}}]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
     [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]),
    ("no call at all", []),
    ("a stray </tool_call> closes nothing", []),
]  # fmt: skip

MALFORMED = [
    (
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}</tool_call>',
        "not valid JSON",
    ),
    ('<tool_call>{"name": "python", "arguments": {"code": "x"}}', "without </tool_call>"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": 7}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', '"arguments" must be'),
    ('<tool_call>{"name": "python", "arguments": "{oops"}</tool_call>', "string but not JSON"),
    ("<tool_call></tool_call>", "not valid JSON"),
]


@pytest.mark.parametrize(("text", "expected"), WELL_FORMED)
def test_well_formed_calls(text: str, expected: list[dict]) -> None:
    calls = parse_tool_calls(text)
    assert all(isinstance(call, ToolCall) for call in calls), calls
    assert [{"name": c.name, "arguments": c.arguments} for c in calls] == expected


@pytest.mark.parametrize(("text", "reason"), MALFORMED)
def test_malformed_calls_become_errors(text: str, reason: str) -> None:
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedToolCall)
    assert reason in call.error


def test_unclosed_call_followed_by_a_good_one() -> None:
    text = '<tool_call>{"name": "a"  <tool_call>{"name": "b"}</tool_call>'
    first, second = parse_tool_calls(text)
    assert isinstance(first, MalformedToolCall) and "without </tool_call>" in first.error
    assert isinstance(second, ToolCall) and second.name == "b"


def test_random_text_never_raises() -> None:
    rng = random.Random(0)
    alphabet = ['<tool_call>', '</tool_call>', '{', '}', '"name"', ':', '"python"', ",", "[", "]",
                '"arguments"', '"code"', "\\", '"', " ", "x", "\n", "```"]  # fmt: skip
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        for call in parse_tool_calls(text):
            assert isinstance(call, ToolCall | MalformedToolCall)
