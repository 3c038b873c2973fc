"""The entry points say what they are: `megatron-fr check` and `megatron-fr rehearse` are
commands of their own (what `train --check` / `--rehearse` do, kept as aliases), and a learner
rank starts from orchestrator/rank_main.py, which refuses to run outside torchrun."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_fr import cli
from megatron_fr.orchestrator import rank_main, train_cli

REPO = Path(__file__).resolve().parents[2]
RECIPE = str(REPO / "examples" / "cpu_demo.yaml")


def test_check_and_rehearse_parse_into_train_with_their_mode_set() -> None:
    check = cli.build_parser("check").parse_args(["check", RECIPE, "a=1", "--world-size", "2"])
    assert (check.check, check.rehearse, check.run_dir) == (True, False, None)
    assert check.run is train_cli.main and check.world_size == 2 and check.overrides == ["a=1"]
    rehearse = cli.build_parser("rehearse").parse_args(["rehearse", RECIPE, "--layers", "2"])
    assert (rehearse.check, rehearse.rehearse, rehearse.layers) == (False, True, 2)
    assert cli.runs_megatron(rehearse) and not cli.runs_megatron(check)
    for argv in (["check", RECIPE, "--layers", "2"], ["rehearse", RECIPE, "--run-dir", "x"]):
        with pytest.raises(SystemExit):  # a flag of another mode is not theirs
            cli.build_parser(argv[0]).parse_args(argv)


def test_check_says_what_train_check_says(tmp_path, capsys) -> None:
    """Both forms on a recipe whose model is missing: the same one-line refusal under the
    command as it was typed, exit 2."""
    missing = f"model.hf_dir={tmp_path / 'none'}"
    assert cli.main(["check", RECIPE, missing]) == 2
    by_check = capsys.readouterr().err
    assert cli.main(["train", RECIPE, "--check", missing]) == 2
    by_train = capsys.readouterr().err
    assert by_check.startswith("megatron-fr check: error: model.hf_dir")
    assert by_check.removeprefix("megatron-fr check") == by_train.removeprefix("megatron-fr train")


def test_the_rank_entry_point_refuses_a_process_torchrun_did_not_start(
    tmp_path, capsys, monkeypatch
) -> None:
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    assert rank_main.main([RECIPE, "--run-dir", str(tmp_path / "run"), "steps=1"]) == 2
    assert "started by torchrun: run `megatron-fr train" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    args = rank_main.parse([RECIPE, "--run-dir", "r", "steps=1", "seed=2"])
    assert args.overrides == ["steps=1", "seed=2"]


def test_the_parent_starts_its_ranks_through_the_rank_entry_point(monkeypatch, tmp_path) -> None:
    """train's re-execution runs torchrun over rank_main with the recipe, run directory and
    overrides, not the parent's CLI again."""
    executed: list[list[str]] = []
    monkeypatch.setattr(train_cli.os, "execv", lambda path, argv: executed.append(argv))
    args = cli.build_parser("train").parse_args(["train", RECIPE, "--run-dir", str(tmp_path)])
    args.overrides = ["steps=1"]
    train_cli._exec_torchrun(2, args)
    (argv,) = executed
    assert argv[:3] == [sys.executable, "-m", "megatron_fr.orchestrator.torchrun"]
    module = argv.index("megatron_fr.orchestrator.rank_main")
    assert argv[module - 1] == "-m"
    assert argv[module + 1 :] == [RECIPE, "--run-dir", str(tmp_path), "steps=1"]
