"""The demo's arithmetic problems: deterministic, disjoint splits that stay put when the
problem set grows, and the tiny Qwen3-MoE config the CPU demo trains."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron_fr.demo.arithmetic import ArithmeticConfig, ArithmeticProblems
from megatron_fr.demo.tiny_models import tiny_model_config
from megatron_fr.models.hf_config import load_hf_config


def all_ids(task: ArithmeticProblems, split: str) -> set[str]:
    return {problem.id for problem in task.problems(split, task.split_size(split))}


def solve(problem_id: str) -> str:
    """The answer, computed from the id text alone."""
    operation = "+" if "+" in problem_id else "-"
    a, b = (int(part) for part in problem_id.split(operation))
    return str(a + b if operation == "+" else a - b)


def test_problems_are_deterministic_and_well_formed():
    task = ArithmeticProblems()
    first = task.problems("train", 50)
    assert first == ArithmeticProblems(ArithmeticConfig()).problems("train", 50)
    assert first == task.problems("train", 50, seed=0)  # the config seed is the default
    assert first != task.problems("train", 50, seed=1)
    assert len({problem.id for problem in first}) == 50
    for problem in first:
        assert len(problem.id) == 5 and problem.id[2] == "+"  # zero-padded operands
        assert problem.answer == solve(problem.id)


def test_splits_are_disjoint_cover_every_problem_and_hold_out_about_the_fraction():
    task = ArithmeticProblems(ArithmeticConfig(eval_fraction=0.2))
    train, held_out = all_ids(task, "train"), all_ids(task, "eval")
    assert not train & held_out
    assert train | held_out == {f"{a:02d}+{b:02d}" for a in range(100) for b in range(100)}
    assert 0.17 < len(held_out) / 10_000 < 0.23
    reseeded = all_ids(ArithmeticProblems(ArithmeticConfig(eval_fraction=0.2, seed=1)), "eval")
    assert reseeded != held_out  # the seed salts the partition


def test_a_problem_keeps_its_split_when_digits_or_operations_change():
    one_digit = ArithmeticProblems(ArithmeticConfig(digits=1))
    two_digits = all_ids(ArithmeticProblems(ArithmeticConfig(digits=2)), "eval")
    both = ArithmeticProblems(ArithmeticConfig(operations=("-", "+")))
    assert {f"0{i[0]}+0{i[2]}" for i in all_ids(one_digit, "eval")} <= two_digits
    assert {i for i in all_ids(both, "eval") if "+" in i} == two_digits
    assert any("-" in i for i in all_ids(both, "eval"))


def _split_ids(config: ArithmeticConfig) -> dict[str, set[str]]:
    problems = ArithmeticProblems(config)
    return {
        split: {p.id for p in problems.problems(split, problems.split_size(split))}
        for split in ("train", "eval")
    }


def _swapped(problem_id: str, width: int) -> str:
    return problem_id[width + 1 :] + problem_id[width] + problem_id[:width]


def test_commuted_together_puts_both_orders_of_a_sum_in_one_split():
    """Every held-out a + b has b + a held out too (none trained with its terms swapped);
    a difference keeps its order (a - b and b - a are different problems); without the
    option about a tenth of the held-out sums are trained on in the other order."""
    config = ArithmeticConfig(digits=2, operations=("+", "-"), commuted_together=True)
    ids = _split_ids(config)
    sums = [i for i in ids["eval"] if "+" in i]
    assert sums and all(_swapped(i, 2) in ids["eval"] for i in sums)
    differences = [i for i in ids["eval"] if "-" in i and i[:2] != i[3:]]
    assert sum(_swapped(i, 2) in ids["train"] for i in differences) > len(differences) / 2
    plain = _split_ids(ArithmeticConfig(digits=2))
    leaked = sum(_swapped(i, 2) in plain["train"] for i in plain["eval"])
    assert 0.8 * len(plain["eval"]) < leaked < len(plain["eval"])  # 1 - 0.1 of them


def test_a_request_longer_than_the_split_continues_with_fresh_shuffles():
    task = ArithmeticProblems(ArithmeticConfig(digits=1))
    size = task.split_size("train")
    drawn = task.problems("train", 2 * size + 3)
    assert len({p.id for p in drawn[:size]}) == size
    assert {p.id for p in drawn[size : 2 * size]} == {p.id for p in drawn[:size]}
    assert drawn[:size] != drawn[size : 2 * size]


def test_subtraction_answers_are_right():
    task = ArithmeticProblems(ArithmeticConfig(operations=("+", "-")))
    every = [
        *task.problems("train", task.split_size("train")),
        *task.problems("eval", task.split_size("eval")),
    ]
    assert all(problem.answer == solve(problem.id) for problem in every)
    assert "-99" in {problem.answer for problem in every}


def test_config_is_frozen_and_validated():
    with pytest.raises(ValidationError):
        ArithmeticConfig(digits=4)
    with pytest.raises(ValidationError):
        ArithmeticConfig(operations=("*",))
    with pytest.raises(ValidationError):
        ArithmeticConfig(operations=("+", "+"))
    with pytest.raises(ValidationError):
        ArithmeticConfig(carry=True)
    with pytest.raises(ValidationError):
        ArithmeticConfig().digits = 3
    with pytest.raises(ValueError, match="split"):
        ArithmeticProblems().problems("test", 1)


def test_tiny_model_config_builds_a_qwen3_moe_model_with_the_given_vocabulary():
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = tiny_model_config(vocab_size=64)
    fields = {key: value for key, value in config.items() if key != "model_type"}
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]](**fields))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.get_input_embeddings().weight.shape[0] == 64
    assert model.get_output_embeddings().weight.shape[0] == 64
    spec = load_hf_config(config)  # what the megatron builder reads
    assert spec.is_moe and spec.num_experts % 2 == 0 and spec.num_key_value_heads % 2 == 0
    assert spec.vocab_size % 8 == 0 and not spec.tie_word_embeddings
    assert tiny_model_config(vocab_size=32)["vocab_size"] == 32
