"""plot_run / `megatron-fr plot`: a real PNG from a synthetic run, and clear errors."""

from __future__ import annotations

import argparse
import json
import math

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import imread

from megatron_fr.analysis import plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def synthetic_run(run_dir, steps=40, eval_every=10):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, steps + 1):
        lines.append(
            {
                "step": step,
                "policy_version": step,
                "reward_mean": 1 - math.exp(-step / 10),
                "acceptance_rate": 0.8 + 0.1 * math.sin(step),
                "lag_mean": 1.0 + 0.5 * math.cos(step),
                "lag_max": 3,
                "tokens_per_s": 5000.0,
                "rollouts_total": 64 * step + (step % 3),  # steps consume unequal rollout counts
            }
        )
        if step % eval_every == 0:
            lines.append(
                {
                    "step": step,
                    "rollouts_total": lines[-1]["rollouts_total"],
                    "eval_accuracy": step / 100,
                    "eval_accuracy_std": 0.02,
                }
            )
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (run_dir / "metrics.jsonl").write_text(text + '{"step": 41, "rew')  # killed mid-line
    return run_dir


def parse(argv):
    parser = argparse.ArgumentParser()
    plot.add_arguments(parser)
    return parser.parse_args(argv)


def test_plot_run_writes_a_png(tmp_path, capsys):
    run_dir = synthetic_run(tmp_path / "run-a")
    assert plot.main(parse([str(run_dir)])) == 0
    out = run_dir / "metrics.png"
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _channels = imread(out).shape
    assert (width, height) == (1600, 700)


def test_out_flag_chooses_the_file(tmp_path):
    run_dir = synthetic_run(tmp_path / "run-b")
    out = tmp_path / "figures" / "b.png"
    assert plot.main(parse([str(run_dir), "--out", str(out)])) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert not (run_dir / "metrics.png").exists()


def test_missing_metrics_exit_2_naming_the_path(tmp_path, capsys):
    empty = tmp_path / "empty-run"
    empty.mkdir()
    assert plot.main(parse([str(empty)])) == 2
    err = capsys.readouterr().err
    assert str(empty / "metrics.jsonl") in err
    assert plot.main(parse([str(tmp_path / "nowhere")])) == 2
    assert str(tmp_path / "nowhere") in capsys.readouterr().err


def test_missing_metric_panel_says_no_data(tmp_path):
    records = [{"step": 1, "rollouts_total": 8, "reward_mean": 0.5}]
    ax: Axes = Figure().subplots()
    plot._draw_panel(ax, records, "step", ("eval_accuracy",))
    assert [t.get_text() for t in ax.texts] == ["no data"]
    ax = Figure().subplots()
    plot._draw_panel(ax, records, "step", ("reward_mean",))
    assert not ax.texts and len(ax.lines) == 1


def test_eval_spread_is_drawn_as_a_band(tmp_path):
    lines = (synthetic_run(tmp_path / "r") / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines[:-1]]  # the last line is the cut one
    ax: Axes = Figure().subplots()
    plot._draw_panel(ax, records, "rollouts_total", ("eval_accuracy",))
    (band,) = ax.collections
    (line,) = ax.lines
    assert list(line.get_xdata()) == [r["rollouts_total"] for r in records if "eval_accuracy" in r]
    assert band.get_label() == "± std over seeds"


def test_resumed_run_duplicate_steps_keep_the_later_value():
    records = [
        {"step": 1, "reward_mean": 0.1},
        {"step": 2, "reward_mean": 0.2},
        {"step": 2, "reward_mean": 0.9},  # re-run after resuming from the step-1 checkpoint
        {"step": 3, "reward_mean": 1.0},
    ]
    xs, ys, spread = plot._series(records, "step", "reward_mean")
    assert xs.tolist() == [1, 2, 3] and ys.tolist() == [0.1, 0.9, 1.0] and spread is None


def test_named_eval_sets_and_episode_figures_get_their_own_lines_and_panel():
    records = [
        {"step": 1, "reward_mean": 0.5, "turns_mean": 2.5, "tool_calls_mean": 1.0},
        {
            "step": 1,
            "eval_accuracy": 0.4,
            "eval_seen_accuracy": 0.5,
            "eval_seen_accuracy_std": 0.1,
            "eval_unseen_accuracy": 0.3,
        },
    ]
    panels = dict(plot.panels_of(records))
    assert panels["eval accuracy"] == ("eval_seen_accuracy", "eval_unseen_accuracy")
    assert panels["episodes"] == ("turns_mean",)
    assert panels["tool use"] == ("tool_calls_mean",)
    assert "episodes" not in dict(plot.panels_of(records[1:]))  # arithmetic runs: no panel
    assert "tool use" not in dict(plot.panels_of(records[1:]))
    ax: Axes = Figure().subplots()
    plot._draw_panel(ax, records, "step", panels["eval accuracy"])
    assert [line.get_label() for line in ax.lines] == list(panels["eval accuracy"])
    assert len(ax.collections) == 1  # the band of the set that logged its spread


def test_a_run_with_a_pool_of_engines_gets_an_engines_panel(tmp_path):
    """engines_total / serving, times an engine left the pool and the engine-seconds lost, one
    panel, drawn from metrics.jsonl lines as the run writes them."""
    records = [
        {"step": 1, "reward_mean": 0.5, "engines_total": 3, "engines_serving": 3},
        {"step": 2, "engines_total": 3, "engines_serving": 2, "engines_out_total": 1},
        {"step": 3, "engines_total": 3, "engines_serving": 3, "engine_seconds_lost": 7.5},
    ]
    panels = dict(plot.panels_of(records))
    assert panels["engines"] == plot.POOL_KEYS
    assert "engines" not in dict(plot.panels_of([{"step": 1, "reward_mean": 0.5}]))
    ax: Axes = Figure().subplots()
    plot._draw_panel(ax, records, "step", panels["engines"])
    serving = next(line for line in ax.lines if line.get_label() == "engines_serving")
    assert list(serving.get_ydata()) == [3, 2, 3]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot.plot_run(tmp_path).stat().st_size > 0


def test_the_sync_check_panel_draws_the_gaps_when_the_run_logged_them():
    records = [
        {"step": 1, "reward_mean": 0.5, "sync_logprob_gap": 2e-6, "sync_logprob_gap_mean": 1e-6},
        {"step": 2, "reward_mean": 0.6, "sync_logprob_gap": 0.4, "sync_logprob_gap_mean": 0.1},
    ]
    panels = dict(plot.panels_of(records))
    assert panels["sync check"] == plot.SYNC_CHECK_KEYS
    assert "sync check" not in dict(plot.panels_of([{"step": 1, "reward_mean": 0.5}]))
    ax: Axes = Figure().subplots()
    plot._draw_panel(ax, records, "step", panels["sync check"])
    gap = next(line for line in ax.lines if line.get_label() == "sync_logprob_gap")
    assert list(gap.get_ydata()) == [2e-6, 0.4]
