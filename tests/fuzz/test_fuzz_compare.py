"""Fuzz of `megatron-fr compare` and `megatron-fr config reference --out`: seeded bad arguments
(counts out of range, lists that are not, unknown names, an --out that is a file or under one)
and run directories in --out that are damaged, foreign or garbage (metrics.jsonl cut, not
UTF-8, nested 100,000 deep, a step of 1e999, a lone evaluation line, a directory or a FIFO
in place of a log; config.yaml malformed). Every bad one must be refused in exactly one error
line naming the argument or the file, never a traceback or a table; nothing in --out may be
deleted (tests/fuzz/fuzz_harness.py). No case trains: a refusal comes before any run starts,
and where a case would train, `train` is stopped at its start (a silent acceptance). The
garbage run directories sit where the comparison's first run goes, so it reads them as
finished or resumes them."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from fuzz_harness import Case, Started, assert_sound, report, run_case

SEED = 52
COMPARE_ARGS = {
    "--seeds": ["0", "-1", "1.5", "x", "", "1001", "9" * 40, " 3", "٣"],
    "--steps": ["-5", "1e3", "abc", "99999999999"],
    "--group-size": ["0", "1", "-4", "4097", "two"],
    "--selection-seeds": ["0", "-2", "many"],
    "--jobs": ["0", "-1", "1.0"],
    "--lags": ["a,b", "-1", "1001", ",", "1;2", "0,,x"],
    "--estimators": ["nope", ",", "grpo,nope", "GRPO", "grpo;rloo"],
    "--gates": ["nope", ",", "topk,x"],
    "--lrs": ["0", "2", "nan", "inf", "fast", ","],
    "--x": ["time", ""],
}
"""Each option with values it must refuse (argparse names the option)."""


def compare_argv(ws: Path, out: Path, *extra: str, mode: str = "methods") -> list[str]:
    return ["compare", mode, str(ws / "recipe.yaml"), "--out", str(out), *extra]


def argument_cases(ws: Path, rng: random.Random) -> list[Case]:
    cases = []
    for option, values in COMPARE_ARGS.items():
        for value in values:
            mode = "lag" if option == "--gates" else rng.choice(["methods", "lag"])
            argv = compare_argv(ws, ws / "out_args", option, value, mode=mode)
            cases.append(Case(f"compare {mode} {option} {value[:20]!r}", argv, option))
    blocker = ws / "a_file"
    blocker.write_text("keep me")
    for out, names in [(blocker, "--out"), (blocker / "sub", "--out"), ("", "--out")]:
        cases.append(Case(f"compare --out {str(out)[-30:]!r}", compare_argv(ws, out), names))
    cases += [
        Case("compare, no --out", ["compare", "methods", str(ws / "recipe.yaml")], "--out"),
        Case("compare, bad mode", ["compare", "both", str(ws / "recipe.yaml")], "mode"),
        Case(
            "compare methods --gates topk",
            compare_argv(ws, ws / "out_gates", "--gates", "topk"),
            "--gates",
        ),
        Case(
            "compare, a missing recipe",
            ["compare", "methods", str(ws / "missing.yaml"), "--out", str(ws / "o")],
            "missing.yaml",
        ),
        Case(
            "compare, a bad override",
            compare_argv(ws, ws / "out_override", "learner.lrr=1"),
            "lrr",
        ),
        Case(
            "compare, a group size the batch refuses",
            compare_argv(ws, ws / "out_group", "--group-size", "5"),
            "group_size",
        ),
        Case(
            "compare lag, a lag with the capacity's bound",
            compare_argv(ws, ws / "out_lag", "--lags", "1000", "buffer.capacity=1", mode="lag"),
            "buffer",
        ),
    ]
    return cases


def _run_lines(steps: int = 2) -> list[str]:
    lines = [json.dumps({"step": 0, "rollouts_total": 0, "eval_accuracy": 0.2})]
    lines += [
        json.dumps({"step": s, "reward_mean": 0.5, "acceptance_rate": 1.0}) for s in range(1, 3)
    ]
    lines.append(json.dumps({"step": steps, "rollouts_total": 16, "eval_accuracy": 0.4}))
    return lines


def run_dir_cases(ws: Path, rng: random.Random) -> list[Case]:
    """--out holding a first run (flash_reinforce-seed0) that is damaged or garbage."""
    good = _run_lines()
    deep = "[" * 100_000 + "]" * 100_000
    metrics: dict[str, tuple[bytes, str]] = {
        "a lone eval line": (b'{"step": 2, "eval_accuracy": 0.5}\n', "not a run of 2 steps"),
        "a step of 1e999": (
            "\n".join([*good[:1], '{"step": 1e999, "reward_mean": 0.5}', *good[2:]]).encode(),
            "step Infinity",
        ),
        "nested deep": ("\n".join([good[0], deep, *good[1:]]).encode(), "nested too deep"),
        "not UTF-8": ("\n".join(good[:2]).encode() + b"\n\xff\xfe\n" + good[3].encode(), "UTF-8"),
        "a list line": ("\n".join([good[0], "[]", *good[1:]]).encode(), "not a JSON object"),
        "an array of steps": (b"[1, 2, 3]\n" + good[3].encode() + b"\n", "not a JSON object"),
        "accuracy 7": (
            "\n".join([*good[:3], '{"step": 2, "eval_accuracy": 7}']).encode() + b"\n",
            "eval_accuracy 7",
        ),
        "accuracy NaN": (
            "\n".join([*good[:3], '{"step": 2, "eval_accuracy": NaN}']).encode() + b"\n",
            "eval_accuracy NaN",
        ),
        "step as text": (
            "\n".join([good[0], '{"step": "1", "reward_mean": 0}', *good[2:]]).encode(),
            'step "1"',
        ),
        "no step key": (
            "\n".join([good[0], '{"reward_mean": 0.5, "acceptance_rate": 1}', *good[2:]]).encode(),
            "step null",
        ),
        "a step twice": (
            "\n".join([*good[:2], good[1], *good[2:]]).encode() + b"\n",
            "not a run of 2 steps",
        ),
        "only incomplete evals": (
            "\n".join([*good[1:3], '{"step": 2, "eval_accuracy": null}']).encode() + b"\n",
            "no complete evaluation",
        ),
        "random bytes": (rng.randbytes(200) + b"\n" + rng.randbytes(50) + b"\n{", "metrics.jsonl"),
    }
    config_texts: dict[str, tuple[bytes, str]] = {
        "config not UTF-8": (b"# commit: x\n\xff\xfe: 1\n", "config.yaml"),
        "config a list": (b"- 1\n- 2\n", "config.yaml"),
        "config unclosed": (b"steps: [1, 2\n", "config.yaml"),
        "config deep": (b"a: " + b"[" * 30_000 + b"]" * 30_000 + b"\n", "config.yaml"),
        "config empty": (b"", "config.yaml"),
    }
    cases = []
    for index, (name, (data, names)) in enumerate({**metrics, **config_texts}.items()):
        out = ws / "outs" / f"case_{index:02d}"
        run = out / "flash_reinforce-seed0"
        run.mkdir(parents=True)
        is_config = name in config_texts
        (run / "metrics.jsonl").write_bytes(
            ("\n".join(good) + "\n").encode() if is_config else data
        )
        (run / "config.yaml").write_bytes(data if is_config else b"# commit: x\nsteps: 2\n")
        cases.append(_run_dir_case(ws, out, name, names))
    for name, make in [
        ("metrics a directory", lambda p: p.mkdir()),
        ("metrics a FIFO", os.mkfifo),
        ("metrics a dangling symlink", lambda p: p.symlink_to(p.parent / "gone")),
    ]:
        out = ws / "outs" / name.replace(" ", "_")
        (out / "flash_reinforce-seed0").mkdir(parents=True)
        make(out / "flash_reinforce-seed0" / "metrics.jsonl")
        cases.append(_run_dir_case(ws, out, name, "metrics.jsonl"))
    return cases


def _run_dir_case(ws: Path, out: Path, name: str, names: str) -> Case:
    argv = compare_argv(ws, out, "--seeds", "1", "--estimators", "flash_reinforce", "--steps", "2")
    return Case(f"compare, first run: {name}", argv, names, watch=out)


def reference_cases(ws: Path) -> list[Case]:
    blocker = ws / "ref_file"
    blocker.write_text("keep")
    fifo = ws / "ref_fifo"
    os.mkfifo(fifo)
    cases = [
        Case(f"config reference --out {name}", ["config", "reference", "--out", str(out)], "--out")
        for name, out in [
            ("a directory", ws),
            ("under a file", blocker / "config.md"),
            ("a FIFO", fifo),
            ("under a missing folder", ws / "missing" / "config.md"),
            ("with a NUL", ws / "a\x00b.md"),
        ]
    ]
    good = ws / "reference.md"
    cases.append(
        Case("config reference --out a file", ["config", "reference", "--out", str(good)], None)
    )
    return cases


def good_cases(ws: Path) -> list[Case]:
    """Accepted: training would start (stopped there: train's subprocess is the end)."""
    return [
        Case("compare, good arguments", compare_argv(ws, ws / "good_1", "--seeds", "1"), None),
        Case(
            "compare lag, good lags",
            compare_argv(ws, ws / "good_2", "--lags", "0,2", "--seeds", "2", mode="lag"),
            None,
        ),
    ]


@pytest.fixture
def no_training(monkeypatch):
    """A comparison that would train a run has accepted its input: the case ends there."""
    from megatron_fr.analysis import compare

    def started(*_args, **_kwargs):
        raise Started

    monkeypatch.setattr(compare.Runs, "_train", started)
    monkeypatch.setattr(compare, "run_provenance", lambda _dir: {"model_sha256": None})


def test_fuzz_compare_and_config_reference(workspace, no_training):
    from megatron_fr.cli import main

    seed = int(os.environ.get("FUZZ_SEED", SEED))
    rng = random.Random(seed)
    cases = [
        *argument_cases(workspace, rng),
        *run_dir_cases(workspace, rng),
        *reference_cases(workspace),
        *good_cases(workspace),
    ]
    results = [run_case(case, main) for case in cases]
    assert (workspace / "a_file").read_text() == "keep me"
    assert_sound(report("compare + config reference", seed, results))
