"""The arithmetic task: vocabulary, deterministic disjoint splits, exact-match reward, and the
tiny Qwen3-MoE config the CPU demo trains."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from megatron_fr.config.run import load_run_config
from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.tasks import build_task
from megatron_fr.tasks.arithmetic import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    ArithmeticConfig,
    ArithmeticTask,
    Problem,
    decode,
    encode,
    tiny_model_config,
)

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "cpu_arithmetic.yaml"


def all_ids(task: ArithmeticTask, split: str) -> set[str]:
    return {problem.id for problem in task.problems(split, task.split_size(split))}


def solve(problem_id: str) -> str:
    """The answer, computed from the id text alone."""
    operation = "+" if "+" in problem_id else "-"
    a, b = (int(part) for part in problem_id.split(operation))
    return str(a + b if operation == "+" else a - b)


def test_vocabulary_round_trips_and_refuses_unknown_characters():
    assert VOCAB_SIZE == 16 and len({PAD_ID, BOS_ID, EOS_ID}) == 3
    assert decode(list(range(VOCAB_SIZE))) == "<pad><bos><eos>0123456789+-="
    assert encode(decode(list(range(VOCAB_SIZE)))) == list(range(VOCAB_SIZE))
    for text in ["12+34=46", "<bos>99-07=92<eos>", "-5", ""]:
        assert decode(encode(text)) == text
    assert encode("<eos>") == [EOS_ID]
    with pytest.raises(ValueError, match="'x'"):
        encode("1x2")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode([VOCAB_SIZE])


def test_problems_are_deterministic_and_well_formed():
    task = ArithmeticTask()
    first = task.problems("train", 50)
    assert first == ArithmeticTask(ArithmeticConfig()).problems("train", 50)
    assert first == task.problems("train", 50, seed=0)  # the config seed is the default
    assert first != task.problems("train", 50, seed=1)
    assert len({problem.id for problem in first}) == 50
    for problem in first:
        assert decode(problem.prompt_ids) == f"<bos>{problem.id}="
        assert len(problem.id) == 5 and problem.id[2] == "+"  # zero-padded operands
        assert problem.answer == solve(problem.id)


def test_splits_are_disjoint_cover_every_problem_and_hold_out_about_the_fraction():
    task = ArithmeticTask(ArithmeticConfig(eval_fraction=0.2))
    train, held_out = all_ids(task, "train"), all_ids(task, "eval")
    assert not train & held_out
    assert train | held_out == {f"{a:02d}+{b:02d}" for a in range(100) for b in range(100)}
    assert 0.17 < len(held_out) / 10_000 < 0.23
    reseeded = all_ids(ArithmeticTask(ArithmeticConfig(eval_fraction=0.2, seed=1)), "eval")
    assert reseeded != held_out  # the seed salts the partition


def test_a_problem_keeps_its_split_when_digits_or_operations_change():
    one_digit = ArithmeticTask(ArithmeticConfig(digits=1))
    two_digits = all_ids(ArithmeticTask(ArithmeticConfig(digits=2)), "eval")
    both = ArithmeticTask(ArithmeticConfig(operations=("-", "+")))
    assert {f"0{i[0]}+0{i[2]}" for i in all_ids(one_digit, "eval")} <= two_digits
    assert {i for i in all_ids(both, "eval") if "+" in i} == two_digits
    assert any("-" in i for i in all_ids(both, "eval"))


def test_a_request_longer_than_the_split_continues_with_fresh_shuffles():
    task = ArithmeticTask(ArithmeticConfig(digits=1))
    size = task.split_size("train")
    drawn = task.problems("train", 2 * size + 3)
    assert len({p.id for p in drawn[:size]}) == size
    assert {p.id for p in drawn[size : 2 * size]} == {p.id for p in drawn[:size]}
    assert drawn[:size] != drawn[size : 2 * size]


def test_subtraction_answers_and_max_new_tokens_fit_the_longest_answer():
    task = ArithmeticTask(ArithmeticConfig(operations=("+", "-")))
    every = [
        *task.problems("train", task.split_size("train")),
        *task.problems("eval", task.split_size("eval")),
    ]
    assert all(problem.answer == solve(problem.id) for problem in every)
    assert "-99" in {problem.answer for problem in every}
    longest = max(len(task.target_ids(problem)) for problem in every)
    assert longest == task.max_new_tokens == 4
    assert task.stop_token_ids == (EOS_ID,)


@pytest.mark.parametrize(
    ("generated", "reward"),
    [
        ("68<eos>", 1.0),
        ("68<eos>12<pad>", 1.0),  # whatever follows the first EOS is ignored
        ("68", 0.0),  # EOS is required
        ("680<eos>", 0.0),
        ("6<eos>", 0.0),
        ("67<eos>", 0.0),
        ("=68<eos>", 0.0),
        ("068<eos>", 0.0),
        ("<pad>68<eos>", 0.0),
        ("<eos>68<eos>", 0.0),
        ("", 0.0),
    ],
)
def test_reward_is_exact_match_up_to_the_first_eos(generated, reward):
    problem = Problem(id="23+45", prompt_ids=encode("<bos>23+45="), answer="68")
    assert ArithmeticTask().reward(problem, encode(generated)) == reward


def test_config_is_frozen_validated_and_registered():
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
        ArithmeticTask().problems("test", 1)
    config = load_run_config(RECIPE, ["task.digits=1", "task.operations=['-']"]).task
    assert isinstance(build_task(config), ArithmeticTask) and config.operations == ("-",)


def test_tiny_model_config_builds_a_qwen3_moe_model_with_the_task_vocabulary():
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = tiny_model_config()
    fields = {key: value for key, value in config.items() if key != "model_type"}
    model = AutoModelForCausalLM.from_config(CONFIG_MAPPING[config["model_type"]](**fields))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert model.get_input_embeddings().weight.shape[0] == VOCAB_SIZE
    assert model.get_output_embeddings().weight.shape[0] == VOCAB_SIZE
    assert model.config.eos_token_id == EOS_ID and model.config.pad_token_id == PAD_ID
    spec = load_hf_config(config)  # what the megatron builder reads
    assert spec.is_moe and spec.num_experts % 2 == 0 and spec.num_key_value_heads % 2 == 0
    assert spec.vocab_size % 8 == 0 and not spec.tie_word_embeddings
    assert tiny_model_config(vocab_size=32)["vocab_size"] == 32
