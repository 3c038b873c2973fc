"""The base of every configuration schema: unknown keys refused, frozen, and finite.

A recipe is typed by hand and overridden on command lines, so a number in it may be anything
YAML reads: `.inf`, `.nan`, `1e400`. None of those is a setting: an infinite learning rate
trains NaN weights, an infinite temperature samples garbage, an infinite timeout waits forever
(and a float past 1e9 overflows the thread and event-loop timeouts it reaches). So every
float must be finite and at most MAX_MAGNITUDE in size, and every integer fit in 64 bits,
unless its field says otherwise (`Field(allow_inf_nan=True)`, e.g. the gate threshold whose
infinity switches the gate off).
"""

from __future__ import annotations

import math
import reprlib
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

MAX_MAGNITUDE = 1e9
"""Largest finite float a setting may hold (seconds, rates, sizes as floats)."""
MAX_INTEGER = 2**63 - 1
"""Largest integer a setting may hold in size: what torch, numpy and C code take (int64)."""

_SHORT = reprlib.Repr()
"""Values quoted in errors: short, whatever their size (a recipe may hold anything YAML can)."""
_SHORT.maxlevel, _SHORT.maxdict, _SHORT.maxlist = 2, 3, 3
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 40


class StrictModel(BaseModel):
    """Unknown keys are refused (a typo is an error, not a default), values are frozen, and
    numbers are finite and at most MAX_MAGNITUDE in size (module docstring). The docstring
    under each field is its description (shown by `megatron-fr config show` and in
    docs/config.md)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    @field_validator("*", mode="after")
    @classmethod
    def _not_absurd(cls, value: Any) -> Any:
        if isinstance(value, float) and math.isfinite(value) and abs(value) > MAX_MAGNITUDE:
            raise ValueError(f"out of range (at most {MAX_MAGNITUDE:g} in size)")
        if isinstance(value, int) and abs(value) > MAX_INTEGER:
            raise ValueError("out of range (at most 2**63 - 1 in size)")
        return value


def describe(error: ValidationError, prefix: str = "") -> str:
    """A pydantic error as one line: `key.path: reason (got value)` for each problem."""
    problems = []
    for problem in error.errors():
        key = prefix + ".".join(str(part) for part in problem["loc"])
        reason = problem["msg"].removeprefix("Value error, ")
        value = problem.get("input")
        shown = "" if isinstance(value, dict) else f" (got {_SHORT.repr(value)})"
        problems.append(f"{key or 'the config'}: {reason}{shown}")
    return "; ".join(problems)
