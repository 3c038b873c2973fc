"""A token-level Task for the warm-start tests: the demo's arithmetic problems in a 16-id
vocabulary (no tokenizer), so that what the warm start trains on can be decoded by hand.

    "<bos>23+05=" -> "28<eos>"; reward 1.0 iff the ids before the first EOS are the answer.
"""

from __future__ import annotations

import dataclasses
import random
import re

from megatron_fr.demo.arithmetic import SLIPS, ArithmeticConfig, ArithmeticProblems, Problem
from megatron_fr.demo.tiny_models import tiny_model_config

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
CHARACTERS = "0123456789+-="
VOCAB_SIZE = len(SPECIALS) + len(CHARACTERS)
_ID_OF = {text: token for token, text in SPECIALS.items()} | {
    char: len(SPECIALS) + i for i, char in enumerate(CHARACTERS)
}
_TEXT_OF = {token: text for text, token in _ID_OF.items()}
_PIECE = re.compile("|".join(re.escape(piece) for piece in sorted(_ID_OF, key=len, reverse=True)))


def encode(text: str) -> list[int]:
    """One id per character; '<pad>', '<bos>', '<eos>' spell the special tokens."""
    return [_ID_OF[match.group()] for match in _PIECE.finditer(text)]


def decode(ids: list[int]) -> str:
    return "".join(_TEXT_OF[token] for token in ids)


def model_config() -> dict:
    """The demo's tiny Qwen3-MoE shape for this vocabulary."""
    return tiny_model_config(VOCAB_SIZE) | dict(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )


class TokenArithmetic:
    """The warm start's Task protocol over ArithmeticProblems, in the 16-id vocabulary."""

    name = "token_arithmetic"
    pad_id = PAD_ID
    stop_token_ids = (EOS_ID,)

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config = config or ArithmeticConfig()
        self._problems = ArithmeticProblems(self.config)

    @property
    def max_new_tokens(self) -> int:
        return self.config.digits + 2

    def problems(self, split: str, count: int, seed: int | None = None) -> list[Problem]:
        drawn = self._problems.problems(split, count, seed)  # type: ignore[arg-type]
        return [dataclasses.replace(p, prompt_ids=[BOS_ID, *encode(p.id + "=")]) for p in drawn]

    def target_ids(self, problem: Problem) -> list[int]:
        return [*encode(problem.answer), EOS_ID]

    def slip_target_ids(self, problem: Problem, rng: random.Random) -> list[int]:
        return [*encode(str(int(problem.answer) + rng.choice(SLIPS))), EOS_ID]

    def reward(self, problem: Problem, output_ids: list[int]) -> float:
        if EOS_ID not in output_ids:
            return 0.0
        response = list(output_ids[: list(output_ids).index(EOS_ID)])
        return 1.0 if response == encode(problem.answer) else 0.0
