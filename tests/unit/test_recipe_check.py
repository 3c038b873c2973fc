"""`megatron-fr train RECIPE --check`: each of the five paper recipes passes on CPU with a model
directory holding the model's public config.json and the project's tiny tokenizer, and its
prompt files replaced by the repo's sample files of the same schema; bad recipes are refused
before any process starts, naming the key or file and the reason."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_fr.config.run import load_run_config
from megatron_fr.orchestrator.check import CheckFailed, check_recipe

REPO = Path(__file__).resolve().parents[2]
EXAMPLES, DATA = REPO / "examples", REPO / "examples" / "data"
PRESETS = REPO / "megatron_fr" / "models" / "presets"
RECIPES = {  # recipe: (public config, learner ranks, sample file for every prompt file)
    "qwen3_30b_a3b_lag8": ("qwen3-30b-a3b", 16, "python_tool.jsonl"),
    "r1_distill_qwen_1p5b_lag4": ("deepseek-r1-distill-qwen-1.5b", 8, "r1_distill_math.parquet"),
    "qwen2p5_math_1p5b": ("qwen2.5-math-1.5b", 8, "dapo_math.jsonl"),
    "qwen2p5_7b_python_tool": ("qwen2.5-7b-instruct", 8, "python_tool.jsonl"),
    "qwen2p5_7b_alfworld": ("qwen2.5-7b-instruct", 8, "alfworld_games.jsonl"),
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory) -> Path:
    from megatron_fr.demo.chat_tokenizer import build_chat_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    chats = [[{"role": "user", "content": "What is 2 + 2? Use python if it helps."}]]
    build_chat_tokenizer(chats, vocab_size=300).save_pretrained(directory)
    return directory


def model_dir(tmp_path: Path, preset: str, tokenizer_files: Path) -> Path:
    directory = tmp_path / preset
    shutil.copytree(tokenizer_files, directory)
    shutil.copy(PRESETS / f"{preset}.json", directory / "config.json")
    return directory


def data_overrides(recipe: str, sample: str) -> list[str]:
    config = load_run_config(EXAMPLES / f"{recipe}.yaml")
    sets = [f"task.eval_sets.{name}.path={DATA / sample}" for name in config.task.eval_sets]
    return [f"task.train.path={DATA / sample}", *sets]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_each_paper_recipe_passes_the_check(tmp_path, tokenizer_files, recipe):
    preset, world, sample = RECIPES[recipe]
    overrides = [
        f"model.hf_dir={model_dir(tmp_path, preset, tokenizer_files)}",
        *data_overrides(recipe, sample),
    ]
    config = load_run_config(EXAMPLES / f"{recipe}.yaml", overrides)
    summary = check_recipe(config, world, gpu_mem_gb=80)
    assert f"task        {config.task.name}" in summary
    assert f"layout      {world} ranks" in summary and "fits" in summary
    assert "NOT" not in summary
    if config.task.name != "alfworld":  # ALFWorld rows carry no prompt: the game prints it
        assert "first prompt" in summary and "would be dropped" in summary


def test_the_command_line_check_prints_the_summary_and_starts_nothing(tmp_path, tokenizer_files):
    preset, world, sample = RECIPES["qwen3_30b_a3b_lag8"]
    run_dir = tmp_path / "never"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_fr",
            "train",
            str(EXAMPLES / "qwen3_30b_a3b_lag8.yaml"),
            "--check",
            "--world-size",
            str(world),
            "--gpu-mem-gb",
            "80",
            "--run-dir",
            str(run_dir),
            f"model.hf_dir={model_dir(tmp_path, preset, tokenizer_files)}",
            *data_overrides("qwen3_30b_a3b_lag8", sample),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "recipe OK (nothing was started)" in result.stdout
    # the paper's 18,432-token rows fit the micro-batches (9,216 tokens per GPU x CP2)
    assert "rows        up to 18432 tokens; a micro-batch holds 18433" in result.stdout
    assert "TP4 PP1 CP2 EP8 ETP1 DP2" in result.stdout
    assert "with learner.recompute selective of 80 GiB: fits" in result.stdout
    assert not run_dir.exists()


def test_the_check_refuses_rows_a_micro_batch_cannot_hold():
    """The CPU demo's rows reach 128 + 24 tokens; 64 tokens per micro-batch hold 65."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_fr",
            "train",
            str(EXAMPLES / "cpu_demo.yaml"),
            "--check",
            "learner.micro_batch_tokens=64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert (
        "learner.micro_batch_tokens: rows reach 152 tokens (task.max_prompt_tokens 128 + "
        "task.max_new_tokens 24), but a micro-batch of learner.micro_batch_tokens 64 x "
        "parallel.context 1 holds rows of at most 65; set learner.micro_batch_tokens >= 151"
    ) in result.stderr


def test_the_check_judges_memory_with_the_recipes_recompute(tmp_path, tokenizer_files):
    """The flagship without CP holds its rows in micro-batches of 18,432 tokens, which fit 78
    GiB only with recompute (the planner: 75.66 GiB without, 54.54 with selective, and the 4
    GiB reserve): the check names the setting and the one that would fit."""
    preset, world, sample = RECIPES["qwen3_30b_a3b_lag8"]
    overrides = [
        f"model.hf_dir={model_dir(tmp_path, preset, tokenizer_files)}",
        *data_overrides("qwen3_30b_a3b_lag8", sample),
        "parallel.context=1",
        "learner.micro_batch_tokens=18432",
    ]
    config = load_run_config(EXAMPLES / "qwen3_30b_a3b_lag8.yaml", overrides)
    assert "fits" in check_recipe(config, world, gpu_mem_gb=78, render=False)
    refused = load_run_config(
        EXAMPLES / "qwen3_30b_a3b_lag8.yaml", [*overrides, "learner.recompute=none"]
    )
    with pytest.raises(
        CheckFailed,
        match=r"learner.recompute: with none the layout needs .* "
        r"more than 78 GiB; set learner.recompute=selective",
    ):
        check_recipe(refused, world, gpu_mem_gb=78, render=False)


def bad_cases(tmp_path: Path) -> list[tuple[str, list[str], str]]:
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text(json.dumps({"id": "a", "question": "2+2?", "answer": "4"}) + "\n")
    return [
        ("unknown key", ["task.max_prompt_tokenz=10"], "max_prompt_tokenz"),
        ("missing data file", [f"task.train.path={tmp_path / 'nope.jsonl'}"], "does not exist"),
        ("no prompt field", [f"task.train.path={no_prompt}"], "'problem'"),
        ("no tokenizer", [f"model.hf_dir={PRESETS}"], "no config.json"),
        (
            "SGLang without CUDA",
            [
                "rollout.engine.kind=sglang",
                f"rollout.engine.python={tmp_path / 'no-python'}",
                "weights.spot_check=0",
            ],
            "rollout.engine.kind is 'sglang', which needs CUDA GPUs, and this machine has none",
        ),
    ]


@pytest.mark.parametrize("index", range(5))
def test_a_bad_recipe_is_refused_by_train_before_any_process_starts(tmp_path, index, demo_model):
    name, overrides, message = bad_cases(tmp_path)[index]
    if name == "SGLang without CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: SGLang is no mistake here")
    if not any(item.startswith("model.hf_dir=") for item in overrides):
        overrides = [f"model.hf_dir={demo_model}", *overrides]
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_fr",
            "train",
            str(EXAMPLES / "cpu_demo.yaml"),
            "--run-dir",
            str(run_dir),
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, (name, result.stderr[-2000:])
    assert message in result.stderr and "Traceback" not in result.stderr, (name, result.stderr)
    assert not run_dir.exists(), name


def test_a_model_directory_without_a_tokenizer_fails_the_check(tmp_path):
    directory = tmp_path / "bare"
    directory.mkdir()
    shutil.copy(PRESETS / "qwen3-8b.json", directory / "config.json")
    config = load_run_config(
        EXAMPLES / "qwen2p5_math_1p5b.yaml",
        [f"model.hf_dir={directory}", *data_overrides("qwen2p5_math_1p5b", "dapo_math.jsonl")],
    )
    with pytest.raises(CheckFailed, match="no usable tokenizer with a chat template"):
        check_recipe(config, 8, None)


def test_moe_with_tensor_parallelism_needs_sequence_parallelism(tmp_path, tokenizer_files):
    """megatron's own rule, read from the installed megatron-core (MoELayer.forward raises,
    in training, at the first step) and evaluated here for each layout: the check refuses
    exactly the layouts megatron would, naming the keys."""
    megatron_dir = next(iter(importlib.util.find_spec("megatron").submodule_search_locations))
    path = Path(megatron_dir) / "core/transformer/moe/moe_layer.py"
    layer = next(
        node
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "MoELayer"
    )
    forward = next(node for node in layer.body if getattr(node, "name", "") == "forward")
    rule = next(
        node.test
        for node in ast.walk(forward)
        if isinstance(node, ast.If) and "sequence_parallel" in ast.unparse(node.test)
    )
    preset, world, sample = RECIPES["qwen3_30b_a3b_lag8"]
    base = [
        f"model.hf_dir={model_dir(tmp_path, preset, tokenizer_files)}",
        *data_overrides("qwen3_30b_a3b_lag8", sample),
    ]
    for tp, sp in [(1, False), (2, False), (4, False), (2, True), (4, True)]:
        layout = [f"parallel.tensor={tp}", f"parallel.sequence_parallel={str(sp).lower()}"]
        config = load_run_config(EXAMPLES / "qwen3_30b_a3b_lag8.yaml", [*base, *layout])
        moe_layer = SimpleNamespace(
            training=True,
            config=SimpleNamespace(sequence_parallel=sp),
            attn_tp_group=SimpleNamespace(size=lambda tp=tp: tp),
        )
        raises = eval(compile(ast.Expression(rule), str(path), "eval"), {"self": moe_layer})
        try:
            check_recipe(config, world, gpu_mem_gb=None, render=False)
            refusal = None
        except CheckFailed as error:
            refusal = str(error)
        assert (refusal is not None) == raises, (tp, sp, refusal)
        if refusal:
            assert f"parallel.tensor={tp} needs parallel.sequence_parallel=true" in refusal


def test_a_spot_check_of_sglang_engines_is_refused_for_a_family_sglang_cannot_read_back(
    demo_model,
):
    """SGLang's /get_weights_by_name exists for a few model families only (read from its
    model classes in test_weight_transports.py): a recipe whose started SGLang engines serve
    another family (the demo's qwen3_moe) is refused by the check, not at the first sync; the
    same recipe with weights.spot_check=0, or with the CPU engine, passes."""
    recipe = EXAMPLES / "cpu_demo.yaml"
    sglang = [f"model.hf_dir={demo_model}", "rollout.engine.kind=sglang"]
    config = load_run_config(recipe, sglang)
    assert config.weights.spot_check > 0
    with pytest.raises(CheckFailed, match="SGLang does not read back the weights of qwen3_moe"):
        check_recipe(config, config.learner_world, None, render=False)
    for overrides in ([*sglang, "weights.spot_check=0"], [f"model.hf_dir={demo_model}"]):
        config = load_run_config(recipe, overrides)
        check_recipe(config, config.learner_world, None, render=False)
