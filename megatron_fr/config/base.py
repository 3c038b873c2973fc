"""The base of every configuration schema: unknown keys refused, frozen, and finite.

A recipe is typed by hand and overridden on command lines, so a number in it may be anything
YAML reads: `.inf`, `.nan`, `1e400`. None of those is a setting: an infinite learning rate
trains NaN weights, an infinite temperature samples garbage, an infinite timeout waits forever
(and a float past 1e9 overflows the thread and event-loop timeouts it reaches). So every
number must be finite and at most MAX_MAGNITUDE in size, unless its field says otherwise
(`Field(allow_inf_nan=True)`, e.g. the gate threshold whose infinity switches the gate off).
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

MAX_MAGNITUDE = 1e9
"""Largest finite float a setting may hold (seconds, rates, sizes as floats)."""


class StrictModel(BaseModel):
    """Unknown keys are refused (a typo is an error, not a default), values are frozen, and
    numbers are finite and at most MAX_MAGNITUDE in size (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _not_absurd(cls, value: Any) -> Any:
        if isinstance(value, float) and math.isfinite(value) and abs(value) > MAX_MAGNITUDE:
            raise ValueError(f"out of range (at most {MAX_MAGNITUDE:g} in size)")
        return value


def describe(error: ValidationError, prefix: str = "") -> str:
    """A pydantic error as one line: `key.path: reason (got value)` for each problem."""
    problems = []
    for problem in error.errors():
        key = prefix + ".".join(str(part) for part in problem["loc"])
        shown = repr(problem.get("input"))
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        reason = problem["msg"].removeprefix("Value error, ")
        problems.append(f"{key or 'the config'}: {reason} (got {shown})")
    return "; ".join(problems)
