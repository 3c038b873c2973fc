"""`megatron-fr compare`'s inputs: its arguments refused by argparse with their range, and the
run directories it reads back checked by one reader (analysis/compare_reader.py) that
names the file and line, so that no malformed or foreign run directory reaches a table and no
error is a traceback. Nothing here trains: the refusals come before any run starts, and the
finished runs are written by hand in the form a run writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_fr.analysis import compare
from megatron_fr.analysis.compare_reader import (
    RunDirError,
    read_finished,
    read_records,
    state,
)
from megatron_fr.cli import main

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "cpu_demo.yaml"


def write_run(run_dir: Path, steps: int = 2, header: str = "# commit: abc\n") -> Path:
    """A finished run of `steps` steps as a run writes it: a step line per step, an
    evaluation at 0 and at the last step, and config.yaml with its header."""
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": 0, "rollouts_total": 0, "eval_accuracy": 0.25}]
    for step in range(1, steps + 1):
        lines.append(
            {"step": step, "reward_mean": 0.5, "acceptance_rate": 0.9, "response_length_mean": 7}
        )
    lines.append({"step": steps, "rollouts_total": 16 * steps, "eval_accuracy": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run_dir / "config.yaml").write_text(header + "steps: 2\nseed: 0\n")
    return run_dir


def test_a_finished_run_is_read_whole(tmp_path):
    run = read_finished(write_run(tmp_path / "r"), steps=2)
    assert [r["step"] for r in run.records] == [0, 1, 2, 2] and run.header == {"commit": "abc"}
    assert state(tmp_path / "r", 2) == "finished" and state(tmp_path / "none", 2) == "missing"


def test_a_skipped_steps_nan_kl_is_read_and_left_out_of_the_mean(tmp_path):
    from megatron_fr.analysis.compare_report import summarise

    run_dir = write_run(tmp_path / "r")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:-1] + ', "sequence_kl_mean": NaN}'
    lines[2] = lines[2][:-1] + ', "sequence_kl_mean": 0.002}'
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    records = read_finished(run_dir, 2).records
    assert summarise("v", 0, run_dir, 8, records=records).kl == 0.002


def test_a_last_line_cut_short_by_a_kill_is_left_out_and_the_run_is_partial(tmp_path):
    run_dir = write_run(tmp_path / "r", steps=2)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(lines[:-1]) + '\n{"step": 2, "eval_acc')
    assert len(read_records(run_dir)) == 3 and state(run_dir, 2) == "partial"


LINES = [  # a line that replaces the run's second, and what the error must name
    ("[1, 2]", "not a JSON object"),
    ("{", "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    ('{"step": 1e999, "reward_mean": 0.5, "acceptance_rate": 1}', "step Infinity"),
    ('{"step": "1", "reward_mean": 0.5, "acceptance_rate": 1}', 'step "1"'),
    ('{"step": true, "reward_mean": 0.5, "acceptance_rate": 1}', "step true"),
    ('{"step": -1, "reward_mean": 0.5, "acceptance_rate": 1}', "step -1"),
    ('{"reward_mean": 0.5, "acceptance_rate": 1}', "step null"),
    ('{"step": 1, "reward_mean": NaN, "acceptance_rate": 1}', "reward_mean NaN"),
    ('{"step": 1, "reward_mean": 0.5}', "acceptance_rate null"),
    ('{"step": 1, "reward_mean": 0.5, "acceptance_rate": 7}', "outside 0 to 1"),
    ('{"step": 1, "eval_accuracy": "high"}', "eval_accuracy"),
    ('{"step": 1, "eval_accuracy": 0.5, "rollouts_total": -3}', "negative"),
]


@pytest.mark.parametrize(("line", "names"), LINES, ids=[n for _, n in LINES])
def test_a_malformed_line_is_named_with_its_file_and_line(tmp_path, line, names):
    run_dir = write_run(tmp_path / "r")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = line
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(RunDirError) as caught:
        read_records(run_dir)
    message = str(caught.value)
    assert message.startswith(f"{run_dir / 'metrics.jsonl'}:2: ") and names in message
    assert "\n" not in message and len(message) < 400


def test_bytes_that_are_not_utf8_are_named_with_their_line(tmp_path):
    run_dir = write_run(tmp_path / "r")
    (run_dir / "metrics.jsonl").write_bytes(b'{"step": 0}\n\xff\xfe{}\n{"step": 1}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl:2: not UTF-8"):
        read_records(run_dir)


@pytest.mark.parametrize(
    ("lines", "names"),
    [
        ([{"step": 2, "eval_accuracy": 0.5}], "not a run of 2 steps"),
        (
            [{"step": s, "reward_mean": 0, "acceptance_rate": 1} for s in (1, 1, 2)]
            + [{"step": 2, "eval_accuracy": 0.5}],
            "not a run of 2 steps",
        ),
        (
            [{"step": s, "reward_mean": 0, "acceptance_rate": 1} for s in (1, 2)]
            + [{"step": 2, "eval_accuracy": None}],
            "no complete evaluation",
        ),
    ],
    ids=["a lone evaluation line", "a step twice", "no accuracy"],
)
def test_garbage_that_looks_finished_never_enters_a_table(tmp_path, lines, names):
    run_dir = write_run(tmp_path / "r")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert state(run_dir, 2) == "finished"
    with pytest.raises(RunDirError, match=names):
        read_finished(run_dir, 2)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (b"\xff\xfe steps: 2", "not UTF-8"),
        (b"steps: [1, 2\n", "not YAML"),
        (b"- 1\n- 2\n", "not a mapping"),
        (b"a: " + b"[" * 50_000 + b"]" * 50_000, "config.yaml"),
    ],
    ids=["bytes", "unclosed", "a list", "deep"],
)
def test_a_malformed_config_is_named(tmp_path, text, names):
    run_dir = write_run(tmp_path / "r")
    (run_dir / "config.yaml").write_bytes(text)
    with pytest.raises(RunDirError) as caught:
        read_finished(run_dir, 2)
    assert str(caught.value).startswith(str(run_dir / "config.yaml")) and names in str(caught.value)


def test_a_log_that_is_a_directory_or_a_fifo_is_named_without_blocking(tmp_path):
    import os

    run_dir = tmp_path / "r"
    (run_dir / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(RunDirError, match="not a regular file"):
        state(run_dir, 2)
    (run_dir / "metrics.jsonl").rmdir()
    os.mkfifo(run_dir / "metrics.jsonl")
    with pytest.raises(RunDirError, match="not a regular file"):
        state(run_dir, 2)


ARGUMENTS = [  # extra arguments of `compare methods RECIPE --out DIR`, what the error names
    (["--seeds", "0"], "--seeds"),
    (["--seeds", "-1"], "--seeds"),
    (["--seeds", "100000000000000000000"], "--seeds"),
    (["--steps", "-5"], "--steps"),
    (["--steps", "1.5"], "--steps"),
    (["--group-size", "0"], "--group-size"),
    (["--group-size", "1"], "--group-size"),
    (["--estimators", "nope"], "--estimators"),
    (["--estimators", ","], "--estimators"),
    (["--lags", "a,b"], "--lags"),
    (["--lags", "-1"], "--lags"),
    (["--lags", "1001"], "--lags"),
    (["--selection-seeds", "0"], "--selection-seeds"),
    (["--jobs", "0"], "--jobs"),
    (["--lrs", "nan"], "--lrs"),
    (["--x", "time"], "--x"),
]


@pytest.mark.parametrize(("extra", "names"), ARGUMENTS, ids=[" ".join(a) for a, _ in ARGUMENTS])
def test_a_bad_argument_is_refused_by_argparse_in_one_line(tmp_path, capsys, extra, names):
    with pytest.raises(SystemExit) as caught:
        main(["compare", "methods", str(RECIPE), "--out", str(tmp_path / "out"), *extra])
    assert caught.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and names in errors[0], errors
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_or_under_one_is_refused(tmp_path, capsys):
    (tmp_path / "file").write_text("keep")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(SystemExit):
            main(["compare", "methods", str(RECIPE), "--out", str(out)])
        (error,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert "--out" in error and "not a directory" in error
    assert (tmp_path / "file").read_text() == "keep"


def test_a_setting_a_configuration_refuses_is_named_before_anything_is_trained(
    tmp_path, capsys, monkeypatch
):
    """The group size must divide the batch: 64 rollouts in groups of 3 is refused for the
    GRPO configuration, in one line, and no run is started."""
    started = []
    monkeypatch.setattr(compare.Runs, "_train", lambda _self, run: started.append(run))
    monkeypatch.setattr(compare, "run_provenance", lambda _dir: {"model_sha256": None})
    code = main(
        ["compare", "methods", str(RECIPE), "--out", str(tmp_path / "o"), "--group-size", "3"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("megatron-fr compare: error: configuration grpo_g3:"), err
    assert "batch_size" in err[0] and started == []


def test_a_garbage_run_directory_in_out_is_refused_naming_its_file(tmp_path, capsys, monkeypatch):
    """A lone evaluation line where a run is expected was read into the table as a run."""
    out = tmp_path / "o"
    (out / "flash_reinforce-seed0").mkdir(parents=True)
    (out / "flash_reinforce-seed0" / "metrics.jsonl").write_text(
        '{"step": 2, "eval_accuracy": 0.5}\n'
    )
    monkeypatch.setattr(compare, "run_provenance", lambda _dir: {"model_sha256": None})
    argv = ["compare", "methods", str(RECIPE), "--out", str(out), "--seeds", "1"]
    argv += ["--estimators", "flash_reinforce", "--steps", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "flash_reinforce-seed0/metrics.jsonl" in err[0], err
    assert "not a run of 2 steps" in err[0] and not (out / "results.md").exists()
