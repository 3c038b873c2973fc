"""`megatron-fr compare`: its short mode end to end (one seed, one step per run, through the
real training command), and its summary arithmetic on run directories written here."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from training_runs import records, run_megatron_fr

from megatron_fr.analysis import compare, compare_reader
from megatron_fr.analysis import compare_report as report
from megatron_fr.analysis import compare_stats as stats

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "buffer.batch_size=8",
    "buffer.capacity=32",
    "buffer.max_in_flight=16",
    "eval.problems=8",
    "eval.samples=1",
    "eval.every_steps=0",
]


def write_run(run_dir: Path, evals: dict[int, float], acceptance: float, kl: float) -> None:
    run_dir.mkdir(parents=True)
    lines = [{"step": s, "rollouts_total": 0, "eval_accuracy": a} for s, a in evals.items()]
    lines += [
        {
            "step": s,
            "reward_mean": 0.5,
            "acceptance_rate": acceptance,
            "sequence_kl_mean": kl,
            "lag_mean": s % 2,
        }
        for s in range(1, max(evals) + 1)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_summary_finds_the_rollouts_to_reach_the_reference(tmp_path):
    runs = {}
    curves = {
        "fr": [{0: 0.2, 2: 0.5, 4: 0.6}, {0: 0.2, 2: 0.4, 4: 0.6}],
        "grpo": [{0: 0.2, 2: 0.3, 4: 0.45}, {0: 0.2, 2: 0.3, 4: 0.45}],
    }
    for name, seeds in curves.items():
        for seed, evals in enumerate(seeds):
            write_run(tmp_path / f"{name}{seed}", evals, acceptance=0.9, kl=1e-3)
            summary = report.summarise(name, seed, tmp_path / f"{name}{seed}", batch_size=10)
            runs.setdefault(name, []).append(summary)
    curve = stats.mean_curve([run.curve for run in runs["fr"]])
    assert [x for x, _, _ in curve] == [0, 20, 40]
    sample_std = (2 * 0.05**2 / (2 - 1)) ** 0.5  # n - 1 in the denominator
    assert [v for _, m, s in curve for v in (m, s)] == pytest.approx(
        [0.2, 0, 0.45, sample_std, 0.6, 0]
    )
    # GRPO ends at 0.45; FlashREINFORCE's mean is exactly 0.45 at 20 rollouts: 0.5 x GRPO's 40.
    # Resampling the seeds, paired (both have seeds 0 and 1), gives FR means 0.5, 0.45 or 0.4
    # at 20 rollouts (chances 1/4, 1/2, 1/4) and GRPO 0.45 always: 0.5 crosses 0.45 at
    # 0 + (0.25 / 0.3) x 20 = 16.7 (0.417 x); 0.4 crosses it between 20 (0.4) and 40 (0.6), at
    # 20 + (0.05 / 0.2) x 20 = 25 (0.625 x). FR's mean accuracy over the budget: trapezoids
    # (20 x (0.2 + m) / 2 + 20 x (m + 0.6) / 2) / 40 = 0.2 + m / 2 for m its mean at 20: 0.425,
    # resampled 0.4 to 0.45; GRPO's (20 x 0.25 + 20 x 0.375) / 40 = 0.3125.
    table = report.results_table(runs, reference="grpo")
    fr_row = next(line for line in table.splitlines() if line.startswith("| fr |"))
    assert "| fr | recipe | 2 | 0.600 +- 0.000 | [0.600, 0.600] | 0.425 [0.400, 0.450] " in fr_row
    assert "| 0.900 | 1.00e-03 | 0.50 | 20 (0.50x, [0.417x, 0.625x]) |" in fr_row
    grpo_row = next(line for line in table.splitlines() if line.startswith("| grpo |"))
    assert "| 0.450 +- 0.000 | [0.450, 0.450] | 0.312 [0.312, 0.312] " in grpo_row
    assert "40 (1.00x, [1.000x, 1.000x]) |" in grpo_row
    # The gap at 20 rollouts: FR's mean minus GRPO's, 0.15, resampled 0.1 to 0.2.
    gaps = report.gap_table(runs, "grpo", "trained")
    assert "| 20 | +0.150 [0.100, 0.200] |" in gaps and "| 40 | +0.150 [0.150, 0.150] |" in gaps


@pytest.mark.distributed
def test_short_modes_run_every_configuration_end_to_end(tmp_path, demo_model):
    """Both modes into one directory, as a user comparing both would, every run from the
    recipe's model. The lag runs take three steps, to see the lag grow to max_lag.

    Each run is a whole `train` (torchrun, two ranks, an engine), so only the runs that test
    something of their own are made: the methods mode's group estimator (its overrides are
    the methods mode's own), and the lag mode with the top-K gate, the group estimator and the
    ungated run. The Bernoulli gate's lags at max_lag 0 and 2 are pinned by the golden runs
    (tests/e2e/test_golden_steps.py) and its variant's name and settings by
    test_lag_variants_run_flash_reinforce_once_per_gate."""
    out = tmp_path / "compare"
    modes = {
        "methods": (1, ["--estimators", "grpo"], ["grpo_g4"]),
        "lag": (
            3,
            ["--estimators", "flash_reinforce,grpo", "--lags", "0,2", "--gates", "topk"],
            [
                "flash_reinforce_lag0_topk",
                "flash_reinforce_lag2_topk",
                "grpo_g4_lag0",
                "grpo_g4_lag2",
                "flash_reinforce_lag2_no_gate",
            ],
        ),
    }
    recipe = REPO / "examples/cpu_demo.yaml"
    for mode, (steps, options, names) in modes.items():
        command = ["compare", mode, str(recipe), "--out", str(out), "--seeds", "1"]
        command += ["--steps", str(steps), *options, *TINY, f"model.hf_dir={demo_model}"]
        run_megatron_fr(*command, timeout_s=1500)
        table = (out / "results.md").read_text()
        made = json.loads((Path(demo_model) / "warm_start.json").read_text())
        model_hash = made["report"]["model_sha256"]
        assert table.startswith(f"Started from model_sha256: {model_hash}; commit: "), table
        for name in names:
            assert f"| {name} | recipe | 1 |" in table  # the recipe's lr, one seed
            config = (out / f"{name}-seed0" / "config.yaml").read_text()
            assert f"hf_dir: {demo_model}" in config  # every run from the one model
            assert config.startswith(f"# model_sha256: {model_hash}\n# commit: "), config
        assert (out / "accuracy.png").stat().st_size > 10_000
    ungated = (out / "flash_reinforce_lag2_no_gate-seed0" / "config.yaml").read_text()
    assert "delta: .inf" in ungated
    topk = (out / "flash_reinforce_lag2_topk-seed0" / "config.yaml").read_text()
    assert "gate_kl: topk" in topk and "gate_kl: bernoulli" in ungated
    grpo = (out / "grpo_g4_lag2-seed0" / "config.yaml").read_text()
    assert "estimator: grpo" in grpo and "group_size: 4" in grpo and "max_lag: 2" in grpo
    # Each lag run trains at its max_lag once it is that many steps in (the buffer waits for a
    # full staleness budget): batch lags 0, 1, 2 at max_lag 2, 0 throughout at max_lag 0, for
    # GRPO's whole groups as for FlashREINFORCE.
    expected = {
        "flash_reinforce_lag0_topk": [0, 0, 0],
        "flash_reinforce_lag2_topk": [0, 1, 2],
        "flash_reinforce_lag2_no_gate": [0, 1, 2],
        "grpo_g4_lag0": [0, 0, 0],
        "grpo_g4_lag2": [0, 1, 2],
    }
    for name, lags in expected.items():
        rows = records(out / f"{name}-seed0")
        assert [r["lag_max"] for r in rows if "lag_max" in r] == lags, name
        assert [r["lag_mean"] for r in rows if "lag_mean" in r] == lags, name
    # On-policy (lag 0), the engine's top-K log-probs and the learner's of the same ids agree:
    # the top-K gate's KL is rounding noise and it admits every trajectory.
    steps = [r for r in records(out / "flash_reinforce_lag0_topk-seed0") if "acceptance_rate" in r]
    assert len(steps) == 3 and all(r["acceptance_rate"] == 1.0 for r in steps)
    assert max(r["sequence_kl_mean"] for r in steps) < 1e-6


def test_lag_variants_run_flash_reinforce_once_per_gate():
    """--gates: the Bernoulli run keeps its name and settings, the top-K run adds _topk and
    the gate; group estimators (no gate) and the ungated run come once; methods refuses it."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)

    def variants(*options: str) -> dict[str, tuple[str, ...]]:
        args = parser.parse_args(["lag", "r.yaml", "--out", "o", *options])
        return {v.name: v.overrides for v in compare.variants_for(args, batch_size=16)}

    both = variants(
        "--estimators", "flash_reinforce,grpo", "--lags", "0,8", "--gates", "topk,bernoulli"
    )
    assert list(both) == [
        "flash_reinforce_lag0_topk",
        "flash_reinforce_lag0",
        "flash_reinforce_lag8_topk",
        "flash_reinforce_lag8",
        "grpo_g4_lag0",
        "grpo_g4_lag8",
        "flash_reinforce_lag8_no_gate",
    ]
    assert both["flash_reinforce_lag8_topk"] == (
        *both["flash_reinforce_lag8"],
        "learner.flash_reinforce.gate_kl=topk",
    )
    assert not any("gate_kl" in override for override in both["flash_reinforce_lag8"])
    assert list(variants()) == [
        "flash_reinforce_lag0",
        "flash_reinforce_lag2",
        "flash_reinforce_lag8",
        "flash_reinforce_lag8_no_gate",
    ]
    with pytest.raises(SystemExit):
        variants("--gates", "bernoulli,full")
    methods = parser.parse_args(["methods", "r.yaml", "--out", "o", "--gates", "topk"])
    assert compare.run(methods) == 2


def test_a_finished_run_from_another_model_is_refused_not_mixed_in(tmp_path, capsys):
    """A comparison resumed after the model was made again: a finished run whose config.yaml
    names another model hash stops it (nothing trained, nothing overwritten); one from the
    same model is read, and results.md names the commits its runs were trained at."""
    model = tmp_path / "model"
    model.mkdir()
    report_of = {"report": {"model_sha256": "a" * 64}}
    (model / "warm_start.json").write_text(json.dumps(report_of))
    out = tmp_path / "compare"
    run_dir = out / "flash_reinforce-seed0"
    write_run(run_dir, {0: 0.2, 1: 0.4}, acceptance=1.0, kl=0.0)
    config = run_dir / "config.yaml"
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(
        [
            "methods",
            str(REPO / "examples/cpu_demo.yaml"),
            f"model.hf_dir={model}",
            "--out",
            str(out),
            "--seeds",
            "1",
            "--steps",
            "1",
            "--estimators",
            "flash_reinforce",
        ]
    )
    config.write_text(f"# model_sha256: {'b' * 64}\n# commit: 1234abc\nsteps: 1\n")
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    assert compare.run(args) == 2
    error = capsys.readouterr().err
    assert f"sha256 {'b' * 64}" in error and f"model is now {'a' * 64}" in error
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    assert not (out / "results.md").exists()

    config.write_text(f"# model_sha256: {'a' * 64}\n# commit: 1234abc\nsteps: 1\n")
    assert compare.run(args) == 0
    table = (out / "results.md").read_text()
    assert "Runs trained at (commit (runs)): 1234abc (1)." in table
    assert "| flash_reinforce | recipe | 1 | 0.400 +- 0.000 |" in table


FAKE_TRAIN = """
import json, sys, time
from pathlib import Path
run_dir = Path(sys.argv[1])
run_dir.mkdir(parents=True)
start = time.monotonic()
time.sleep(0.5)
seed = int(sys.argv[2])
lines = [{"step": 0, "eval_accuracy": 0.1}, {"step": 1, "eval_accuracy": seed / 10},
         {"step": 1, "reward_mean": 0.5, "acceptance_rate": 1.0, "sequence_kl_mean": 0.0,
          "lag_mean": 0, "started": start, "ended": time.monotonic()}]
(run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\\n" for line in lines))
(run_dir / "config.yaml").write_text("# seed: %d\\nseed: %d\\n" % (seed, seed))
"""


def test_jobs_train_runs_at_once_and_report_them_in_the_planned_order(tmp_path, monkeypatch):
    """--jobs 2: four runs of half a second each, as a stand-in command, two at a time (the
    intervals overlap pairwise); the summaries come back in the planned order, not in the
    order the runs finished, and a second pass trains nothing."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    calls = []

    def fake_command(recipe: Path, run_dir: Path, overrides: list[str]) -> list[str]:
        calls.append(run_dir.name)
        seed = next(item for item in overrides if item.startswith("seed=")).split("=")[1]
        return [sys.executable, str(script), str(run_dir), seed]

    monkeypatch.setattr(compare, "train_command", fake_command)
    runs = compare.Runs(Path("r.yaml"), tmp_path / "out", [], 1, 8, None, jobs=2)
    variant = compare.Variant("fr", ())
    planned = [compare.PlannedRun(variant, f"fr-seed{seed}", seed, None) for seed in range(4)]
    summaries = runs.summaries(planned)
    assert [s.seed for s in summaries] == [0, 1, 2, 3]
    assert [s.curve[-1][1] for s in summaries] == [0.0, 0.1, 0.2, 0.3]
    intervals = []
    for seed in range(4):
        step = compare_reader.read_records(tmp_path / "out" / f"fr-seed{seed}")[-1]
        intervals.append((step["started"], step["ended"]))
    overlapping = sum(
        1
        for i, (start, end) in enumerate(intervals)
        for other_start, other_end in intervals[i + 1 :]
        if start < other_end and other_start < end
    )
    assert overlapping >= 2, intervals  # sequential runs would never overlap
    assert sorted(calls) == [f"fr-seed{seed}" for seed in range(4)]
    calls.clear()
    assert [s.seed for s in runs.summaries(planned)] == [0, 1, 2, 3] and calls == []


def test_a_sweep_whose_best_rate_is_at_the_edge_stops_before_the_compared_runs(
    tmp_path, monkeypatch, capsys
):
    """`compare --lrs` through run(): the stand-in's accuracy does not depend on the rate,
    so the first (lowest) rate wins its tie and sits at the grid's edge; the comparison ends
    with exit 2 and "widen the grid", writes the sweep, and trains none of its own seeds.
    --allow-grid-edge then compares, reusing the sweep's runs."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    trained: list[str] = []

    def fake_command(recipe: Path, run_dir: Path, overrides: list[str]) -> list[str]:
        trained.append(run_dir.name)
        seed = next(item for item in overrides if item.startswith("seed=")).split("=")[1]
        return [sys.executable, str(script), str(run_dir), str(int(seed) % 10)]

    monkeypatch.setattr(compare, "train_command", fake_command)
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    argv = ["methods", str(REPO / "examples/cpu_demo.yaml"), f"model.hf_dir={tmp_path}"]
    argv += ["--out", str(tmp_path / "out"), "--seeds", "1", "--steps", "1"]
    argv += ["--estimators", "flash_reinforce", "--lrs", "1e-4,3e-4,1e-3", "--selection-seeds", "1"]
    assert compare.run(parser.parse_args(argv)) == 2
    error = capsys.readouterr().err
    assert "flash_reinforce's best is 0.0001, the grid's lowest" in error
    assert "Widen the grid" in error
    assert sorted(trained) == sorted(
        f"flash_reinforce-lr{lr}-select1000" for lr in ("0.0001", "0.0003", "0.001")
    )
    sweep = (tmp_path / "out" / "sweep.md").read_text()
    assert "final held-out accuracy" in sweep and "(the grid's lowest: widen it)" in sweep
    assert not (tmp_path / "out" / "results.md").exists()

    trained.clear()
    assert compare.run(parser.parse_args([*argv, "--sweep-only"])) == 0  # reads, trains nothing
    assert trained == [] and "(the grid's lowest: widen it)" in capsys.readouterr().out
    assert compare.run(parser.parse_args([*argv, "--allow-grid-edge"])) == 0
    assert trained == ["flash_reinforce-seed0"]
    assert "(the grid's lowest: widen it)" in (tmp_path / "out" / "results.md").read_text()
