"""JSON read from files a user wrote, where a key given twice is a mistake to name.

The json module keeps the last of two equal keys silently, so `{"answer": "3", "answer": "4"}`
would train on "4" and say nothing; an input read here is refused instead, naming the key.
"""

from __future__ import annotations

import json
from typing import Any


class DuplicateKeyError(ValueError):
    """An object of the document holds a key twice."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise DuplicateKeyError(f"the key {key[:80]!r} appears twice in one object")
        found[key] = value
    return found


def loads_unique(text: str | bytes) -> Any:
    """`json.loads(text)`, refusing an object with a key twice (DuplicateKeyError, a
    ValueError); RecursionError for nesting deeper than the json module follows."""
    return json.loads(text, object_pairs_hook=_unique)
