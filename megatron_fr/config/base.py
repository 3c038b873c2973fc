"""The base of every configuration schema: unknown keys refused, frozen, and finite.

A recipe is typed by hand and overridden on command lines, so a number in it may be anything
YAML reads: `.inf`, `.nan`, `1e400`. None of those is a setting: an infinite learning rate
trains NaN weights, an infinite temperature samples garbage, an infinite timeout waits forever
(and a float past 1e9 overflows the thread and event-loop timeouts it reaches). So every
float must be finite and at most MAX_MAGNITUDE in size, and every integer fit in 64 bits,
unless its field says otherwise (`Field(allow_inf_nan=True)`, e.g. the gate threshold whose
infinity switches the gate off).

Types are strict: `steps: true` is not one step and `steps: '60'` is not sixty (pydantic's lax
mode would take both), so a setting holds a value of its own type. An integer is still a
float (`lr: 1` is 1.0), and a YAML list fills a tuple field (`StrictTuple`), whose items stay
strict.
"""

from __future__ import annotations

import math
import reprlib
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_MAGNITUDE = 1e9
"""Largest finite float a setting may hold (seconds, rates, sizes as floats)."""
MAX_INTEGER = 2**63 - 1
"""Largest integer a setting may hold in size: what torch, numpy and C code take (int64)."""

MIN_SECONDS = 0.01
"""Shortest timeout, deadline or interval a setting may give: less is no time at all to an
event loop or a socket, and a busy loop when it is a watch's interval (`5e-324` is a float)."""
Seconds = Annotated[float, Field(ge=MIN_SECONDS)]
"""A duration in seconds: at least MIN_SECONDS (and at most MAX_MAGNITUDE, as every float)."""
MIN_TEMPERATURE = 1e-3
"""Lowest sampling temperature: logits / temperature must stay finite in float32 and bfloat16
(a denormal temperature makes them inf, the log-probs NaN)."""
Temperature = Annotated[float, Field(ge=MIN_TEMPERATURE)]

Item = TypeVar("Item")
StrictTuple = Annotated[tuple[Item, ...], Field(strict=False)]
"""A tuple setting a YAML list fills (strict mode takes only a tuple); its items are checked
strictly, as every other value."""

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
        extra="forbid",
        frozen=True,
        allow_inf_nan=False,
        strict=True,
        use_attribute_docstrings=True,
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
