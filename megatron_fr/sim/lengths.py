"""Token counts of simulated rollouts: a capped lognormal, or lengths measured in a run.

RL response lengths are long-tailed (most answers are short, a few run to the generation
limit), and the tail is what makes asynchronous training pay: under synchronous training
every step waits for its longest rollout. A lognormal with median m and log-spread sigma,
cut at max_new_tokens (a response that reaches the limit stops there, as generation does),
is the parametric form; a JSONL of measured lengths replaces it when one exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from megatron_fr.sim.config import LengthSettings


@dataclass(frozen=True)
class RolloutLength:
    prompt_tokens: int
    response_tokens: int

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.response_tokens


class LengthSampler(Protocol):
    def draw(self) -> RolloutLength: ...


class LognormalLengths:
    """Response tokens = min(max_new_tokens, max(1, round(m * exp(sigma * Z)))), Z ~ N(0, 1)."""

    def __init__(self, settings: LengthSettings, seed: int) -> None:
        self.settings = settings
        self.rng = np.random.default_rng(seed)

    def draw(self) -> RolloutLength:
        s = self.settings
        value = s.median_tokens * float(np.exp(s.sigma * self.rng.standard_normal()))
        return RolloutLength(s.prompt_tokens, min(s.max_new_tokens, max(1, round(value))))


class MeasuredLengths:
    """Draws (with replacement) from lengths read from a JSONL file."""

    def __init__(self, lengths: list[RolloutLength], seed: int) -> None:
        if not lengths:
            raise ValueError("no lengths to draw from")
        self.lengths = lengths
        self.rng = np.random.default_rng(seed)

    def draw(self) -> RolloutLength:
        return self.lengths[int(self.rng.integers(len(self.lengths)))]


def read_lengths(path: str | Path, default_prompt_tokens: int) -> list[RolloutLength]:
    """One JSON object per line: response_tokens (int >= 1) and optionally prompt_tokens.
    ValueError naming the file, line and field on anything else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"lengths file {path} not found")
    lengths = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected an object with response_tokens")
        response = _count(record, "response_tokens", None, 1, f"{path}:{number}")
        prompt = _count(record, "prompt_tokens", default_prompt_tokens, 0, f"{path}:{number}")
        lengths.append(RolloutLength(prompt, response))
    if not lengths:
        raise ValueError(f"lengths file {path} holds no lengths")
    return lengths


def _count(record: dict, name: str, default: int | None, least: int, where: str) -> int:
    """record[name] (default when absent), an int >= least; else a ValueError at `where`."""
    value = record.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{where}: {name} must be an int >= {least}, got {value!r}")
    return value


def build_sampler(settings: LengthSettings, seed: int) -> LengthSampler:
    if settings.file is not None:
        return MeasuredLengths(read_lengths(settings.file, settings.prompt_tokens), seed)
    return LognormalLengths(settings, seed)
