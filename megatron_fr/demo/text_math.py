"""Arithmetic asked in words, answered in \\boxed{}, graded by math-verify (the CPU text demo).

    row:      {"id": "23+05", "problem": "What is 23 + 5?", "answer": "28"}
    prompt:   the "math" environment's opening messages for the row, rendered by the model's chat
              template with the generation prompt (exactly what the agent loop sends)
    target:   "23 + 5 = \\boxed{28}" then <|im_end|>        (a slip: the boxed answer off by
              1 or 10, as demo/arithmetic.py SLIPS list them)
    reward:   the "math" environment's grade of the decoded response (extraction of the last
              \\boxed{}, math-verify in a worker process)

The problems, their ids and the train/eval partition are ArithmeticProblems' (a hash of the
operands decides the split, so the two are disjoint by construction and stable whatever is
drawn); difficulty is its `digits` and `operations` (the demo: 2 digits, "+"). Rows are plain
dataset rows, so the RL loop reads them like any prompt file (envs/datasets.py), and
write_rows() saves them as one.

The task works in token ids (demo/warm_start.py's Task protocol), which is what the
supervised warm start trains on; it owns a MathEnvironment (grader
worker processes): close() it, or use it as a context manager.
"""

from __future__ import annotations

import random
import re
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from megatron_fr.config.base import StrictModel
from megatron_fr.demo.arithmetic import SLIPS, ArithmeticConfig, ArithmeticProblems, Problem, Split
from megatron_fr.envs.base import Message, Sample
from megatron_fr.envs.datasets import write_jsonl
from megatron_fr.envs.math_env import MathEnvConfig, MathEnvironment, math_messages

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ARITHMETIC_ID = re.compile(r"(\d+)([+-])(\d+)")


class TextMathConfig(StrictModel):
    """Which problems are asked, and how (the environment's wording and grader)."""

    problems: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    """Operand digits, operations, held-out share and split seed (ArithmeticConfig)."""
    environment: MathEnvConfig = Field(default_factory=MathEnvConfig)
    """The "math" environment that words the prompt and grades the answer; RL must use the
    same options for its prompts to be the ones the warm start trained on."""


def operands(problem_id: str) -> tuple[int, str, int]:
    """(a, op, b) of an ArithmeticProblems problem id such as "23+05"."""
    match = _ARITHMETIC_ID.fullmatch(problem_id)
    if match is None:
        raise ValueError(f"{problem_id!r} is not an arithmetic problem id like '23+05'")
    return int(match.group(1)), match.group(2), int(match.group(3))


def question(problem_id: str) -> str:
    a, op, b = operands(problem_id)
    return f"What is {a} {op} {b}?"


def worked_answer(problem_id: str, answer: int | str) -> str:
    """The demonstration's text: the sum restated, then the answer in \\boxed{}."""
    a, op, b = operands(problem_id)
    return f"{a} {op} {b} = \\boxed{{{answer}}}"


def rows(config: TextMathConfig, split: Split, count: int, seed: int | None = None) -> list[Sample]:
    """`count` dataset rows of `split` ({"id", "problem", "answer"}), ArithmeticProblems's draw."""
    drawn = ArithmeticProblems(config.problems).problems(split, count, seed)
    return [{"id": p.id, "problem": question(p.id), "answer": p.answer} for p in drawn]


def write_rows(
    path: str | Path, config: TextMathConfig, split: Split, count: int, seed: int | None = None
) -> Path:
    """rows() saved as a JSONL prompt file."""
    return write_jsonl(path, rows(config, split, count, seed))


def tokenizer_chats(config: TextMathConfig, count: int = 2000) -> list[list[Message]]:
    """Train-split conversations (prompt messages + demonstration) to train a tokenizer on."""
    env = config.environment
    return [
        [
            *math_messages(row, env.system_prompt, env.instruction),
            {"role": "assistant", "content": worked_answer(row["id"], row["answer"])},
        ]
        for row in rows(config, "train", count, seed=0)
    ]


class TextMathTask:
    """TextMath problems as token ids for `tokenizer` (which must carry a chat template).
    Generation stops at <|im_end|> or <|endoftext|>, as Qwen instruct models' do."""

    name = "text_math"

    def __init__(self, config: TextMathConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        from megatron_fr.demo.tiny_models import chat_stop_token_ids
        from megatron_fr.rollout.chat import chat_format

        self.config = config
        self.tokenizer = tokenizer
        self.chat = chat_format(tokenizer, chat_stop_token_ids(tokenizer))
        self.stop_token_ids = self.chat.stop_token_ids
        self.pad_id = tokenizer.pad_token_id
        self.environment = MathEnvironment(config.environment)
        self._arithmetic = ArithmeticProblems(config.problems)
        self._prompt_ids = lru_cache(maxsize=None)(self._render_prompt)

    def __enter__(self) -> TextMathTask:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the grader's worker processes."""
        self.environment.close()

    @cached_property
    def max_new_tokens(self) -> int:
        """The longest demonstration of the task (largest operands, slip included), its
        end-of-turn token, and two tokens of slack."""
        top = 10**self.config.problems.digits - 1
        longest = worked_answer(f"{top}+{top}", 2 * top + max(SLIPS))
        return len(self._encode(longest)) + 1 + 2

    def problems(self, split: Split, count: int, seed: int | None = None) -> list[Problem]:
        """ArithmeticProblems's draw of `count` problems, with chat-rendered prompts."""
        drawn = self._arithmetic.problems(split, count, seed)
        return [Problem(p.id, self._prompt_ids(p.id), p.answer) for p in drawn]

    def split_size(self, split: Split) -> int:
        return self._arithmetic.split_size(split)

    def sample(self, problem: Problem) -> Sample:
        """The dataset row of `problem`."""
        return {"id": problem.id, "problem": question(problem.id), "answer": problem.answer}

    def target_ids(self, problem: Problem) -> list[int]:
        return [*self._encode(worked_answer(problem.id, problem.answer)), self.stop_token_ids[0]]

    def slip_target_ids(self, problem: Problem, rng: random.Random) -> list[int]:
        """The demonstration with the boxed answer off by 1 or 10 (never right)."""
        slip = int(problem.answer) + rng.choice(SLIPS)
        return [*self._encode(worked_answer(problem.id, slip)), self.stop_token_ids[0]]

    def reward(self, problem: Problem, output_ids: list[int]) -> float:
        """The math environment's reward for the decoded response (end-of-turn token cut)."""
        episode = self.environment.start(self.sample(problem))
        return episode.step(self.chat.turn_text(list(output_ids))).reward

    def _render_prompt(self, problem_id: str) -> list[int]:
        row = {"id": problem_id, "problem": question(problem_id), "answer": "0"}
        episode = self.environment.start(row)
        return self.chat.prompt_ids(episode.messages, episode.tools)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def build_text_math_task(
    config: TextMathConfig | None = None, vocab_size: int = 384
) -> TextMathTask:
    """The task with a tokenizer trained on its own chats (chat_tokenizer.build_chat_tokenizer)."""
    from megatron_fr.demo.chat_tokenizer import build_chat_tokenizer

    config = config or TextMathConfig()
    tokenizer = build_chat_tokenizer(tokenizer_chats(config), vocab_size)
    return TextMathTask(config, tokenizer)


def main(argv: list[str] | None = None) -> None:
    """`python -m megatron_fr.demo.text_math OUT_DIR [--train N --eval N ...]`: write the
    prompt files of a text-math recipe (OUT_DIR/train.jsonl and OUT_DIR/eval.jsonl), drawn
    from the same problems a warm start of the same settings uses (demo/config.py's
    `problems`), the held-out ones from the eval split."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m megatron_fr.demo.text_math", description=main.__doc__
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--train", type=int, default=4096, help="training prompts")
    parser.add_argument("--eval", type=int, default=200, help="held-out prompts")
    parser.add_argument("--digits", type=int, default=2, help="operand digits (1-3)")
    parser.add_argument("--operations", default="+", help='drawn from: "+", "-" or "+-"')
    parser.add_argument(
        "--commuted-together",
        action="store_true",
        help="a + b and b + a in the same split (ArithmeticConfig.commuted_together)",
    )
    args = parser.parse_args(argv)
    config = TextMathConfig(
        problems=ArithmeticConfig(
            digits=args.digits,
            operations=tuple(args.operations),
            commuted_together=args.commuted_together,
        )
    )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    splits: tuple[tuple[Split, int], ...] = (("train", args.train), ("eval", args.eval))
    for split, count in splits:
        print(write_rows(args.out_dir / f"{split}.jsonl", config, split, count, seed=0))


if __name__ == "__main__":
    main()
