"""`megatron-fr train` refuses a bad recipe or run directory before any process starts: exit
2 with the file and the reason on stderr, no traceback, nothing created."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def train(recipe: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_fr",
            "train",
            str(recipe),
            "--run-dir",
            str(run_dir),
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def good_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "ok.yaml"
    path.write_text((REPO / "examples" / "cpu_demo.yaml").read_text())
    return path


CASES = [
    (
        "broken yaml",
        lambda t: t / "bad.yaml",
        "steps: 3\nbuffer: {batch_size: 4\n",
        (),
        "not valid YAML at line",
    ),
    ("a directory", lambda t: t, None, (), "is not a file"),
    ("not a mapping", lambda t: t / "list.yaml", "- 1\n- 2\n", (), "must be a mapping"),
    ("unknown key", None, None, ("learner.lrr=1",), "lrr"),
    ("wrong type", None, None, ("steps=many",), "steps"),
    ("bad override value", None, None, ("steps=[1",), "the value is not YAML"),
    ("truncated sampling", None, None, ("rollout.top_p=0.9",), "truncated sampling is refused"),
]


@pytest.mark.parametrize(
    ("name", "where", "text", "overrides", "message"), CASES, ids=[c[0] for c in CASES]
)
def test_a_bad_recipe_is_refused_before_anything_starts(
    tmp_path, name, where, text, overrides, message
):
    recipe = where(tmp_path) if where else good_recipe(tmp_path)
    if text is not None:
        recipe.write_text(text)
    run_dir = tmp_path / "never"
    result = train(recipe, run_dir, *overrides)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert not run_dir.exists()


def test_a_run_directory_that_is_a_file_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.write_text("not a directory")
    result = train(good_recipe(tmp_path), run_dir)
    assert result.returncode == 2
    assert "exists and is not a directory" in result.stderr and "Traceback" not in result.stderr
