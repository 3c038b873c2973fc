"""`megatron-fr train --rehearse`'s arguments refused before anything is built
(launch/rehearse_args.py), and the CPU demo's float32 recipe rehearsed in its own dtype.

A world of 1,000,000,000 ranks grew the rehearsal to 20 GB before the kernel killed it, a skew
of -5 or inf ended in a traceback from the MoE dispatcher, `--check --rank 5` was taken
silently, and the CPU demo's recipe failed with "Expected inputs of BF16 type" from the fake
mode's grouped GEMM. Each is now one line naming the flag, or a rehearsal that runs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_fr.config.run import load_run_config
from megatron_fr.launch.rehearse_args import MAX_WORLD, check_flags, check_world

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"


def arguments(**given: object) -> argparse.Namespace:
    values = {"world_size": 0, "rehearse": True, "rank": None, "stages": False, "skew": 0.0}
    values |= {"cpu_kernels": False, "layers": 0}
    return argparse.Namespace(**(values | given))


@pytest.mark.parametrize(
    ("given", "names"),
    [
        ({"world_size": 1_000_000_000}, "--world-size 1000000000: at most 65536"),
        ({"world_size": MAX_WORLD + 1}, "--world-size"),
        ({"skew": -5.0}, "--skew -5.0"),
        ({"skew": float("inf")}, "--skew inf"),
        ({"skew": float("nan")}, "--skew nan"),
        ({"skew": 1e9}, "--skew"),
        ({"rank": -1}, "--rank -1"),
        ({"layers": -2}, "--layers -2"),
        ({"rehearse": False, "rank": 5}, "--rank applies to --rehearse only"),
        ({"rehearse": False, "rank": 0}, "--rank applies to --rehearse only"),
        ({"rehearse": False, "skew": 1.0}, "--skew applies"),
        ({"rehearse": False, "layers": 2}, "--layers applies"),
        ({"rehearse": False, "cpu_kernels": True}, "--cpu-kernels applies"),
        ({"rehearse": False, "stages": True}, "--stages applies"),
    ],
)
def test_a_flag_out_of_range_or_without_meaning_is_named(given, names):
    with pytest.raises(ValueError, match=names.replace("(", r"\(")):
        check_flags(arguments(**given))


def test_flags_in_range_are_taken():
    check_flags(arguments(skew=0.5, rank=3, layers=2, world_size=MAX_WORLD))
    check_flags(arguments(rehearse=False, world_size=8))


def test_the_world_is_checked_against_the_layout_before_anything_is_built():
    config = load_run_config(RECIPE)  # EP 2
    check_world(config, 4, arguments(rank=3))
    with pytest.raises(ValueError, match=r"--world-size 3 and the recipe's parallel layout: .*ex"):
        check_world(config, 3, arguments())
    with pytest.raises(ValueError, match="--rank 4: the world has ranks 0 to 3"):
        check_world(config, 4, arguments(rank=4))
    with pytest.raises(ValueError, match="world size 65537"):
        check_world(config, MAX_WORLD + 1, arguments())


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatron_fr", "train", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=600)


def test_a_huge_world_is_refused_at_once_in_one_line(tmp_path):
    result = run(str(RECIPE), "--rehearse", "--world-size", "1000000000", cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
    assert "--world-size 1000000000: at most 65536" in errors[0]
    assert "Traceback" not in result.stderr


def test_the_cpu_demos_float32_model_rehearses_in_its_own_dtype(tmp_path):
    """The demo's recipe (float32, EP 2, a Qwen3-MoE-shaped model) on the tiny chat model
    of the agent fixtures: the experts' GEMMs go one per expert, as on a GPU for float32."""
    from agent_fixtures import chat_model_dir

    chat_model_dir(tmp_path / "model")
    recipe = RECIPE.read_text().replace("../runs/models/cpu_demo", str(tmp_path / "model"))
    recipe = recipe.replace("data/cpu_math/", str(REPO / "examples" / "data" / "cpu_math") + "/")
    (tmp_path / "recipe.yaml").write_text(recipe)
    result = run(str(tmp_path / "recipe.yaml"), "--rehearse", "--rank", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1 (stage 0)" in result.stdout and "verdict: fits" in result.stdout
    assert "BF16" not in result.stderr
