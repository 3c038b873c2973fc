"""Qwen-style tool calls in generated text, parsed without ever raising.

    <tool_call>
    {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    </tool_call>

A policy in training writes broken calls all the time; each one must become an error the
policy can read in its next observation, never an exception in the rollout worker. So
`parse_tool_calls` returns, in order, a ToolCall for every well-formed call and a
MalformedToolCall (with the reason) for every other `<tool_call>` opening: unclosed, not
JSON, not an object, no string "name", "arguments" neither an object nor a JSON string of one.
Tolerated because models do it: a ```json fence around the object, and "arguments" given as a
JSON-encoded string (OpenAI style).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    raw: str
    """The text between the tags."""


@dataclass(frozen=True)
class MalformedToolCall:
    raw: str
    error: str
    """Why it is not a call, phrased for the policy to read."""


def _parse_body(raw: str) -> ToolCall | MalformedToolCall:
    body = raw.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        call = json.loads(body)
    except ValueError as error:
        return MalformedToolCall(raw, f"the tool call is not valid JSON ({error})")
    if not isinstance(call, dict):
        return MalformedToolCall(raw, "the tool call must be a JSON object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return MalformedToolCall(raw, 'the tool call needs a string "name"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            return MalformedToolCall(raw, f'"arguments" is a string but not JSON ({error})')
    if not isinstance(arguments, dict):
        return MalformedToolCall(raw, '"arguments" must be a JSON object')
    return ToolCall(name, arguments, raw)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedToolCall]:
    """Every `<tool_call>` of `text`, in order (see the module docstring)."""
    calls: list[ToolCall | MalformedToolCall] = []
    position = text.find(OPEN)
    while position != -1:
        start = position + len(OPEN)
        end = text.find(CLOSE, start)
        reopened = text.find(OPEN, start)
        if end == -1 or (reopened != -1 and reopened < end):
            stop = len(text) if reopened == -1 else reopened
            calls.append(MalformedToolCall(text[start:stop], f"{OPEN} without {CLOSE}"))
            position = reopened
            continue
        calls.append(_parse_body(text[start:end]))
        position = text.find(OPEN, end + len(CLOSE))
    return calls
