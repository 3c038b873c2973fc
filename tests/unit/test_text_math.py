"""Text math problems (tasks/text_math.py): rows and their answers checked by computing them
from the question text, disjoint splits, chat-rendered prompts equal to transformers'
apply_chat_template, and demonstrations / slips graded by math-verify."""

from __future__ import annotations

import random
import re

import pytest

from megatron_fr.demo.arithmetic import ArithmeticConfig, ArithmeticProblems
from megatron_fr.demo.text_math import (
    TextMathConfig,
    build_text_math_task,
    rows,
    tokenizer_chats,
    write_rows,
)
from megatron_fr.envs.datasets import DatasetConfig, load_dataset
from megatron_fr.envs.math_env import MathEnvConfig

QUESTION = re.compile(r"What is (\d+) ([+-]) (\d+)\?")
BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
CONFIG = TextMathConfig(problems=ArithmeticConfig(digits=2, operations=("+", "-")))


@pytest.fixture(scope="module")
def task():
    with build_text_math_task(CONFIG, vocab_size=384) as task:
        yield task


def solve(question: str) -> int:
    a, op, b = QUESTION.fullmatch(question).groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def test_rows_are_worded_questions_with_their_answers():
    drawn = rows(CONFIG, "train", 300)
    assert drawn == rows(CONFIG, "train", 300)  # deterministic
    assert rows(CONFIG, "train", 300, seed=1) != drawn
    for row in drawn:
        assert set(row) == {"id", "problem", "answer"}
        assert row["answer"] == str(solve(row["problem"]))
    assert {QUESTION.fullmatch(r["problem"]).group(2) for r in drawn} == {"+", "-"}
    assert any(r["answer"].startswith("-") for r in drawn)


def test_train_and_eval_are_disjoint_and_cover_every_problem():
    small = TextMathConfig(problems=ArithmeticConfig(digits=1, operations=("+", "-")))
    train = {r["problem"] for r in rows(small, "train", 10_000)}
    held_out = {r["problem"] for r in rows(small, "eval", 1_000)}
    assert not train & held_out
    every = {f"What is {a} {op} {b}?" for a in range(10) for b in range(10) for op in "+-"}
    assert train | held_out == every


def test_prompt_ids_are_the_math_environments_messages_through_the_chat_template(task):
    for problem in task.problems("eval", 20):
        sample = task.sample(problem)
        messages = task.environment.start(sample).messages
        assert messages[-1]["content"].startswith(sample["problem"])
        assert MathEnvConfig().instruction in messages[-1]["content"]
        expected = task.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )["input_ids"]
        assert problem.prompt_ids == expected


def test_demonstrations_are_graded_correct_and_slips_wrong_by_math_verify(task):
    rng = random.Random(0)
    offsets = set()
    for problem in task.problems("train", 40):
        target = task.target_ids(problem)
        assert target[-1] == task.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert len(target) <= task.max_new_tokens
        assert task.reward(problem, target) == 1.0
        slip = task.slip_target_ids(problem, rng)
        assert task.reward(problem, slip) == 0.0
        text = task.tokenizer.decode(slip)
        offsets.add(int(BOXED.search(text).group(1)) - int(problem.answer))
    assert offsets == {-10, -1, 1, 10}
    wrong = task.problems("eval", 1)[0]
    assert task.reward(wrong, task.tokenizer("no answer")["input_ids"]) == 0.0


def test_the_longest_demonstration_fits_max_new_tokens(task):
    top = task.problems("train", ArithmeticProblems(CONFIG.problems).split_size("train"))
    assert max(len(task.target_ids(p)) for p in top) + 2 <= task.max_new_tokens


def test_tokenizer_chats_and_the_task_agree_on_the_prompt_text(task):
    chats = tokenizer_chats(CONFIG, count=5)
    problem = task.problems("train", 5, seed=0)[0]
    assert chats[0][0]["content"].startswith(task.sample(problem)["problem"])
    assert chats[0][1]["content"].endswith(f"\\boxed{{{problem.answer}}}")


def test_rows_written_as_jsonl_load_as_a_prompt_file(tmp_path):
    path = write_rows(tmp_path / "train.jsonl", CONFIG, "train", 50)
    assert load_dataset(DatasetConfig(path=str(path))) == rows(CONFIG, "train", 50)
    assert not list(tmp_path.glob(".*"))  # nothing partial left
