"""The sample prompt files of the paper recipes (examples/data/) load with the settings
examples/data/README.md gives, their answers are right (recomputed here) and graded correct by
math-verify, and each recipe's file starts episodes of its environment."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_fr.envs.datasets import DatasetConfig, load_dataset
from megatron_fr.envs.math_env import MathEnvironment
from megatron_fr.envs.math_grader import MathGrader
from megatron_fr.envs.python_tool import PythonToolEnvironment

DATA = Path(__file__).resolve().parents[2] / "examples" / "data"
VERL = dict(prompt_key="prompt", label_key="reward_model.ground_truth", id_key="extra_info.index")
FILES = {"dapo_math.jsonl": 5, "r1_distill_math.parquet": 4, "python_tool.jsonl": 4}


def verl(name: str) -> list[dict]:
    return load_dataset(DatasetConfig(path=str(DATA / name), **VERL))


@pytest.mark.parametrize(("name", "count"), FILES.items())
def test_verl_layout_files_load_and_grade(name, count):
    samples = verl(name)
    assert len(samples) == count
    with MathGrader() as grader:
        for sample in samples:
            assert [m["role"] for m in sample["messages"]] == ["user"]
            assert sample["problem"] == sample["messages"][0]["content"]
            assert sample["reward_model"]["style"].startswith("rule")
            response = f"So the result follows.\n\\boxed{{{sample['answer']}}}"
            assert grader.grade(response, sample["answer"]).correct, sample["id"]
    if name == "dapo_math.jsonl":  # DAPO's own answer format is graded too
        assert all("Answer: $Answer" in s["problem"] for s in samples)


def test_every_recipe_names_a_sample_file():
    recipes = {p.stem for p in (DATA.parent).glob("*.yaml") if not p.stem.startswith("cpu_")}
    readme = (DATA / "README.md").read_text()
    for recipe in recipes:
        assert f"{recipe}.yaml" in readme, recipe
    for name in [*FILES, "alfworld_games.jsonl"]:
        assert f"`{name}`" in readme and (DATA / name).is_file()


def test_sample_answers_are_right():
    """Recomputed from the problem statements (the files were written by hand)."""
    answers = {s["id"]: s["answer"] for name in FILES for s in verl(name)}
    primes = [n for n in range(2, 2000) if all(n % d for d in range(2, int(n**0.5) + 1))]

    def zeros(n: int) -> int:
        return 0 if n == 0 else n // 5 + zeros(n // 5)

    leg = next(x for x in range(1, 99) if x * x + (x + 7) ** 2 == (x + 8) ** 2)
    expected = {
        "dapo-0001": sum(360 % d == 0 for d in range(1, 361)),
        "dapo-0002": sum(n for n in range(1, 101) if (n * n + 1) % 5 == 0),
        "dapo-0003": leg * (leg + 7) // 2,
        "dapo-0004": pow(3, 100, 7),
        "dapo-0005": 5 * 4 * 3 * 2,
        "r1-0001": 10**3 - 3 * 21 * 10,
        "r1-0002": sum(6 * (a + b) == a * b for a in range(1, 50) for b in range(1, 50)),
        "r1-0003": min(n for n in range(100) if zeros(n) == 10),
        "tool-0001": sum(primes),
        "tool-0002": sum(sum(map(int, str(n))) == 20 for n in range(1, 10**4 + 1)),
        "tool-0003": pow(7, 2024, 1000),
        "tool-0004": sum(x * x + y * y <= 100 for x in range(-10, 11) for y in range(-10, 11)),
    }
    for sample_id, value in expected.items():
        assert answers[sample_id] == str(value), sample_id
    differ_by_one = sum(abs(a - b) == 1 for a in range(1, 7) for b in range(1, 7))
    assert (differ_by_one, answers["r1-0004"]) == (10, "\\frac{5}{18}")  # 10/36


def test_each_file_starts_its_environment():
    with MathEnvironment() as math_env:
        episode = math_env.start(verl("dapo_math.jsonl")[0])
        assert episode.messages[-1]["content"].startswith("Solve the following math problem")
    with PythonToolEnvironment() as tool_env:
        episode = tool_env.start(verl("python_tool.jsonl")[0])
        assert episode.tools and episode.tools[0]["function"]["name"] == "python"


def test_alfworld_rows_name_game_files_under_the_alfworld_data_layout():
    path = DATA / "alfworld_games.jsonl"
    samples = load_dataset(DatasetConfig(path=str(path), prompt_key=None, label_key=None))
    assert {s["extra_info"]["split"] for s in samples} == {"train", "valid_seen", "valid_unseen"}
    for sample, line in zip(samples, path.read_text().splitlines(), strict=True):
        assert sample == json.loads(line)
        assert re.fullmatch(
            r"json_2\.1\.1/(train|valid_seen|valid_unseen)/[\w-]+/trial_T\d+_\d+_\d+/game\.tw-pddl",
            sample["game_file"],
        )
        assert sample["id"] == str(Path(sample["game_file"]).parent.relative_to("json_2.1.1"))
