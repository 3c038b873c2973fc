"""The fuzz surfaces' shared fixtures: a workspace with a tiny model, a few prompts and a recipe,
and `train` stopped where it would start torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest
from fuzz_harness import REPO, Started


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch) -> Path:
    """tmp_path (the working directory) with model/ (a tiny random chat model), data/ (six
    training and three held-out arithmetic prompts) and recipe.yaml (the CPU demo's, using
    them)."""
    from agent_fixtures import chat_model_dir

    chat_model_dir(tmp_path / "model")
    (tmp_path / "data").mkdir()
    rows = (REPO / "examples" / "data" / "cpu_math" / "train.jsonl").read_text().splitlines()
    (tmp_path / "data" / "train.jsonl").write_text("\n".join(rows[:6]) + "\n")
    (tmp_path / "data" / "eval.jsonl").write_text("\n".join(rows[6:9]) + "\n")
    recipe = (REPO / "examples" / "cpu_demo.yaml").read_text()
    recipe = recipe.replace("../runs/models/cpu_demo", "model").replace("data/cpu_math/", "data/")
    (tmp_path / "recipe.yaml").write_text(recipe)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def no_torchrun(monkeypatch):
    """Where `train` would start torchrun, the case ends: it accepted its input."""
    from megatron_fr.orchestrator import train_cli

    def started(*_args) -> None:
        raise Started

    monkeypatch.setattr(train_cli, "_exec_torchrun", started)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
