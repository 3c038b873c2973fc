"""Integer arithmetic ("23+45=" -> "68"), a verifiable task small enough to learn on a CPU.

The demo recipe needs a task whose reward is exact and free to compute, a model that needs no
tokenizer files, and a held-out split that no training problem can leak into. So:

- the vocabulary is fixed (16 ids: PAD, BOS, EOS, the ten digits, '+', '-', '='); operands are
  zero-padded to `digits` characters, so every prompt of a task has the same length and a batch
  of prompts needs no padding; the answer is written without padding and must end with EOS;
- a problem belongs to the eval split iff a hash of (a, op, b, seed) falls below
  `eval_fraction`: the split of a problem never depends on which problems were drawn, how many,
  or in which order, so train and eval are disjoint by construction;
- the reward is 1.0 iff the tokens before the first EOS are exactly the answer (EOS required).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>"}
CHARACTERS = "0123456789+-="
"""Character i has id len(SPECIALS) + i."""
VOCAB_SIZE = len(SPECIALS) + len(CHARACTERS)
assert VOCAB_SIZE % 8 == 0, "embedding tables shard evenly under TP2 only with a multiple of 8"

_ID_OF = {text: token for token, text in SPECIALS.items()} | {
    char: len(SPECIALS) + i for i, char in enumerate(CHARACTERS)
}
_TEXT_OF = {token: text for text, token in _ID_OF.items()}
_PIECE = re.compile("|".join(re.escape(piece) for piece in sorted(_ID_OF, key=len, reverse=True)))
_OPERATION_CODES = {"+": 0, "-": 1}
"""Fixed per operation (not its position in the config), so adding '-' to a task leaves the
split of every '+' problem where it was."""

SLIPS = (-10, -1, 1, 10)
"""What slip_target_ids adds to an answer: never 0, so a slip is always wrong."""

Split = Literal["train", "eval"]


def encode(text: str) -> list[int]:
    """Ids of `text`: one per character; '<pad>', '<bos>', '<eos>' spell the special tokens."""
    ids, position = [], 0
    while position < len(text):
        match = _PIECE.match(text, position)
        if match is None:
            raise ValueError(
                f"{text[position]!r} at position {position} of {text!r} is not in "
                f"the arithmetic vocabulary ({CHARACTERS!r} and {list(SPECIALS.values())})"
            )
        ids.append(_ID_OF[match.group()])
        position = match.end()
    return ids


def decode(ids: list[int]) -> str:
    """The text of `ids` (special tokens spelled out, so decode(encode(text)) == text)."""
    unknown = [token for token in ids if token not in _TEXT_OF]
    if unknown:
        raise ValueError(f"ids {unknown} are outside the vocabulary [0, {VOCAB_SIZE})")
    return "".join(_TEXT_OF[token] for token in ids)


class ArithmeticConfig(BaseModel):
    """Which problems the task poses and how they split into train and eval."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digits: int = Field(default=2, ge=1, le=3)
    """Operand digits: operands are 0 .. 10**digits - 1. At most 3, because the split is found
    by enumerating every problem (a million per operation at 3 digits)."""
    operations: tuple[Literal["+", "-"], ...] = ("+",)
    """Operations drawn from; '-' brings negative answers ("-12")."""
    eval_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """Expected share of all problems held out for evaluation."""
    seed: int = 0
    """Salts the train/eval partition and is the default seed for drawing problems."""

    @field_validator("operations")
    @classmethod
    def _distinct_operations(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"operations must be non-empty and distinct, got {value}")
        return value


@dataclass(frozen=True)
class Problem:
    id: str
    """The prompt text without '=', e.g. "23+05": unique within a task and stable across runs."""
    prompt_ids: list[int]
    """BOS, then the prompt text, e.g. "23+05=", as ids."""
    answer: str
    """The exact text to generate before EOS, e.g. "28"."""


class ArithmeticTask:
    """Draws problems from either split and scores generated tokens by exact match."""

    name = "arithmetic"
    pad_id = PAD_ID
    stop_token_ids = (EOS_ID,)

    def __init__(self, config: ArithmeticConfig | None = None):
        self.config = config or ArithmeticConfig()

    @property
    def max_new_tokens(self) -> int:
        """The longest answer ("-99" or "198" at 2 digits) plus its EOS."""
        return self.config.digits + 2

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

    def target_ids(self, problem: Problem) -> list[int]:
        """What a correct response is, token for token: the answer, then EOS."""
        return [*encode(problem.answer), EOS_ID]

    def slip_target_ids(self, problem: Problem, rng: random.Random) -> list[int]:
        """A plausible wrong response, as a careless solver writes it: the answer off by 1 or
        by 10 (a units or a carry slip) in either direction, then EOS. Noisy demonstrations
        made of these teach the skill with a calibrated error rate (see learner/warm_start)."""
        return [*encode(str(int(problem.answer) + rng.choice(SLIPS))), EOS_ID]

    def reward(self, problem: Problem, output_ids: list[int]) -> float:
        """1.0 iff the tokens up to the first EOS (which must be there) are exactly the answer."""
        if EOS_ID not in output_ids:
            return 0.0
        response = list(output_ids[: list(output_ids).index(EOS_ID)])
        return 1.0 if response == encode(problem.answer) else 0.0

    @cached_property
    def _split_keys(self) -> dict[str, np.ndarray]:
        """Every problem of the task as an integer key (operation, a, b), grouped by split."""
        base = 10**self.config.digits
        operands = np.arange(base * base, dtype=np.uint64)
        codes = np.array([_OPERATION_CODES[op] for op in self.config.operations], dtype=np.uint64)
        keys = (codes[:, None] * np.uint64(base * base) + operands[None, :]).reshape(-1)
        held_out = _unit_hash(keys, base, self.config.seed) < self.config.eval_fraction
        return {"train": keys[~held_out], "eval": keys[held_out]}

    def _problem(self, key: int) -> Problem:
        base = 10**self.config.digits
        code, pair = divmod(key, base * base)
        a, b = divmod(pair, base)
        operation = "+-"[code]
        text = f"{a:0{self.config.digits}d}{operation}{b:0{self.config.digits}d}"
        answer = str(a + b if operation == "+" else a - b)
        return Problem(id=text, prompt_ids=[BOS_ID, *encode(text + "=")], answer=answer)


def _unit_hash(keys: np.ndarray, base: int, seed: int) -> np.ndarray:
    """A uniform number in [0, 1) per problem: splitmix64 of (operation, a, b, seed).

    Built from the operands themselves rather than the key, so a problem's split does not
    change with `digits` (e.g. "7+8" and "07+08" are the same problem, in the same split).
    """
    code, pair = np.divmod(keys, np.uint64(base * base))
    a, b = np.divmod(pair, np.uint64(base))
    x = (a << np.uint64(12)) | (b << np.uint64(2)) | code  # a, b < 1024
    x = x ^ (np.uint64(seed & 0xFFFFFFFF) << np.uint64(32))
    with np.errstate(over="ignore"):  # splitmix64 relies on wrap-around multiplication
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def tiny_model_config(vocab_size: int = VOCAB_SIZE) -> dict:
    """config.json of the demo's Qwen3-MoE-shaped policy: every part of the production model
    (GQA with q/k norm, RoPE, top-k routed experts with normalised weights, untied embeddings),
    small enough that the warm start and RL run in minutes on two CPU cores. Key-value heads
    and experts are even, so the learner can run it at TP2 or EP2."""
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        hidden_act="silu",
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
