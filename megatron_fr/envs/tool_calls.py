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

The text is the policy's, so parsing it is bounded: a call longer than MAX_CALL_CHARS or nested
deeper than MAX_DEPTH is refused before json.loads sees it (the json module recurses once per
level, so `<tool_call>` and a thousand `[` would otherwise raise RecursionError in the worker).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
MAX_CALL_CHARS = 65_536
"""Longest call body that is parsed (a policy turn is bounded by its token budget; this bounds
what one call may cost whatever that budget is)."""
MAX_DEPTH = 32
"""Deepest nesting of JSON arrays and objects in a call, the call object being level 1 (real
tool arguments are a few levels deep)."""


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


class _Refused(ValueError):
    """A call body that is not parsed: the reason, for the policy to read."""


def _nesting(text: str, limit: int) -> int:
    """How deep [ and { nest in `text`, outside JSON strings; stops counting past `limit`."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif in_string:
            escaped = char == "\\"
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif char in "]}":
            depth -= 1
    return deepest


def _loads(text: str, levels_above: int, not_json: str) -> Any:
    """json.loads within the bounds (module docstring); _Refused saying why not (`not_json`
    followed by json's reason, for text that is not JSON)."""
    if _nesting(text, MAX_DEPTH - levels_above) > MAX_DEPTH - levels_above:
        raise _Refused(f"the tool call is nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except ValueError as error:
        raise _Refused(f"{not_json} ({error})") from None


def _parse_body(raw: str) -> ToolCall | MalformedToolCall:
    try:
        return _parse_call(raw)
    except _Refused as refused:
        return MalformedToolCall(raw, str(refused))


def _parse_call(raw: str) -> ToolCall | MalformedToolCall:
    if len(raw) > MAX_CALL_CHARS:
        raise _Refused(f"the tool call is longer than {MAX_CALL_CHARS} characters")
    body = raw.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    call = _loads(body, 0, "the tool call is not valid JSON")
    if not isinstance(call, dict):
        return MalformedToolCall(raw, "the tool call must be a JSON object")
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return MalformedToolCall(raw, 'the tool call needs a string "name"')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        not_json = '"arguments" is a string but not JSON'
        arguments = _loads(arguments, 1, not_json) if arguments.strip() else {}
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
