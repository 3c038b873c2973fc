"""Integer arithmetic problems ("23+05" -> 28): the CPU demo's verifiable task.

The demo needs a task whose reward is exact and free to compute and a held-out split that no
training problem can leak into. So a problem belongs to the eval split iff a hash of
(a, op, b, seed) falls below `eval_fraction`: the split of a problem never depends on which
problems were drawn, how many, or in which order, so train and eval are disjoint by
construction. The problems are asked in words and graded by math-verify (demo/text_math.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from megatron_fr.config.base import StrictModel, StrictTuple

_OPERATION_CODES = {"+": 0, "-": 1}
"""Fixed per operation (not its position in the config), so adding '-' to a task leaves the
split of every '+' problem where it was."""

SLIPS = (-10, -1, 1, 10)
"""What a slipped demonstration adds to an answer: never 0, so a slip is always wrong."""

Split = Literal["train", "eval"]


class ArithmeticConfig(StrictModel):
    """Which problems the task poses and how they split into train and eval."""

    digits: int = Field(default=2, ge=1, le=3)
    """Operand digits: operands are 0 .. 10**digits - 1. At most 3, because the split is found
    by enumerating every problem (a million per operation at 3 digits)."""
    operations: StrictTuple[Literal["+", "-"]] = ("+",)
    """Operations drawn from; '-' brings negative answers ("-12")."""
    eval_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """Expected share of all problems held out for evaluation."""
    seed: int = 0
    """Salts the train/eval partition and is the default seed for drawing problems."""
    commuted_together: bool = False
    """Put a + b and b + a in the same split, so no held-out sum is trained on with its
    terms swapped (off: each order falls on its own, and about a tenth of the held-out sums
    are trained on in the other order; kept for the recipes whose models were made so)."""

    @field_validator("operations")
    @classmethod
    def _distinct_operations(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"operations must be non-empty and distinct, got {value}")
        return value


@dataclass(frozen=True)
class Problem:
    id: str
    """The operands and operation, e.g. "23+05": unique within a task and stable across runs."""
    prompt_ids: list[int]
    """The prompt as the policy's tokenizer renders it (empty where no tokenizer is involved)."""
    answer: str
    """The exact answer, e.g. "28"."""


class ArithmeticProblems:
    """Draws problems from either split."""

    def __init__(self, config: ArithmeticConfig | None = None):
        self.config = config or ArithmeticConfig()

    def problems(self, split: Split, count: int, seed: int | None = None) -> list[Problem]:
        """`count` problems of `split`, the same for the same (config, split, count, seed).

        Drawn without replacement while the split lasts; a longer request continues with
        fresh shuffles of the split (epochs), so training can ask for as many as it needs.
        """
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        keys = self._split_keys[split]
        rng = random.Random(f"{split}/{self.config.seed if seed is None else seed}")
        chosen: list[int] = []
        while len(chosen) < count:
            chosen += rng.sample(range(len(keys)), min(count - len(chosen), len(keys)))
        return [self._problem(int(keys[index])) for index in chosen]

    def split_size(self, split: Split) -> int:
        return len(self._split_keys[split])

    @cached_property
    def _split_keys(self) -> dict[str, np.ndarray]:
        """Every problem of the task as an integer key (operation, a, b), grouped by split."""
        base = 10**self.config.digits
        operands = np.arange(base * base, dtype=np.uint64)
        codes = np.array([_OPERATION_CODES[op] for op in self.config.operations], dtype=np.uint64)
        keys = (codes[:, None] * np.uint64(base * base) + operands[None, :]).reshape(-1)
        held_out = (
            _unit_hash(keys, base, self.config.seed, self.config.commuted_together)
            < self.config.eval_fraction
        )
        return {"train": keys[~held_out], "eval": keys[held_out]}

    def _problem(self, key: int) -> Problem:
        base = 10**self.config.digits
        code, pair = divmod(key, base * base)
        a, b = divmod(pair, base)
        operation = "+-"[code]
        text = f"{a:0{self.config.digits}d}{operation}{b:0{self.config.digits}d}"
        answer = str(a + b if operation == "+" else a - b)
        return Problem(id=text, prompt_ids=[], answer=answer)


def _unit_hash(keys: np.ndarray, base: int, seed: int, commuted_together: bool) -> np.ndarray:
    """A uniform number in [0, 1) per problem: splitmix64 of (operation, a, b, seed).

    Built from the operands themselves rather than the key, so a problem's split does not
    change with `digits` (e.g. "7+8" and "07+08" are the same problem, in the same split).
    With `commuted_together`, a sum's operands are hashed in order (smaller first), so a + b
    and b + a get the same number; a difference keeps its order (a - b is another problem).
    """
    code, pair = np.divmod(keys, np.uint64(base * base))
    a, b = np.divmod(pair, np.uint64(base))
    if commuted_together:
        is_sum = code == np.uint64(_OPERATION_CODES["+"])
        a, b = np.where(is_sum, np.minimum(a, b), a), np.where(is_sum, np.maximum(a, b), b)
    x: np.ndarray = (a << np.uint64(12)) | (b << np.uint64(2)) | code  # a, b < 1024
    x = x ^ (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32))
    with np.errstate(over="ignore"):  # splitmix64 relies on wrap-around multiplication
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)
