"""Qwen-style tool-call parsing: well-formed calls come out as ToolCall, every broken one as a
MalformedToolCall with a reason, and nothing raises (random text included)."""

from __future__ import annotations

import random

import pytest

from megatron_fr.envs.tool_calls import (
    MAX_CALL_CHARS,
    MAX_DEPTH,
    MalformedToolCall,
    ToolCall,
    parse_tool_calls,
)

CODE = {"name": "python", "arguments": {"code": "print(1)"}}

WELL_FORMED = [
    ('<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>', [CODE]),
    (
        'I will compute.<tool_call>{"name":"python","arguments":{"code":"print(1)"}}</tool_call>'
        " Done.",
        [CODE],
    ),
    (
        '<tool_call>```json\n{"name": "python", "arguments": {"code": "print(1)"}}\n```'
        "</tool_call>",
        [CODE],
    ),
    (
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>',
        [CODE],
    ),
    ('<tool_call>{"name": "now"}</tool_call>', [{"name": "now", "arguments": {}}]),
    (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
        [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}],
    ),
    ("no call at all", []),
    ("a stray </tool_call> closes nothing", []),
]

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
    alphabet = [
        "<tool_call>",
        "</tool_call>",
        "{",
        "}",
        '"name"',
        ":",
        '"python"',
        ",",
        "[",
        "]",
        '"arguments"',
        '"code"',
        "\\",
        '"',
        " ",
        "x",
        "\n",
        "```",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
        for call in parse_tool_calls(text):
            assert isinstance(call, ToolCall | MalformedToolCall)


NESTED = 1000
"""Deeper than Python's recursion limit allows json.loads to go."""
BOUNDED = [
    ("<tool_call>" + "[" * NESTED + "</tool_call>", "nested deeper than"),
    ("<tool_call>" + "[" * NESTED + "]" * NESTED + "</tool_call>", "nested deeper than"),
    (
        '<tool_call>{"name": "python", "arguments": "' + "[" * NESTED + '"}</tool_call>',
        "nested deeper than",
    ),
    (
        '<tool_call>{"name": "python", "arguments": {"code": '
        + '{"a": ' * NESTED
        + "1"
        + "}" * NESTED
        + "}}</tool_call>",
        "nested deeper than",
    ),
    ("<tool_call>" + " " * (MAX_CALL_CHARS + 1) + "{}</tool_call>", "longer than"),
]


@pytest.mark.parametrize(("text", "reason"), BOUNDED)
def test_deep_or_huge_calls_are_tool_errors_not_exceptions(text: str, reason: str) -> None:
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedToolCall) and reason in call.error, call.error[:200]
    assert len(call.error) < 200  # a reason for the policy, not its text echoed back


def test_nesting_and_strings_within_the_bounds_still_parse() -> None:
    depth = MAX_DEPTH - 2  # the call object and "arguments" are two levels
    code = '"[[[ \\" {{ not structure }} ]]]"'  # brackets inside strings are not nesting
    nested = "[" * depth + code + "]" * depth
    text = f'<tool_call>{{"name": "f", "arguments": {{"x": {nested}}}}}</tool_call>'
    (call,) = parse_tool_calls(text)
    assert isinstance(call, ToolCall), call
    value = call.arguments["x"]
    for _ in range(depth):
        (value,) = value
    assert value == '[[[ " {{ not structure }} ]]]'
