"""`megatron-fr lengths RUN_DIR [RUN_DIR ...]`: whether the stale drop falls on long episodes.

A trajectory that spans weight updates is as old as its oldest token, so with
buffer.stale_policy = drop_trajectory the rollouts in flight longest, the long (multi-turn)
ones, are the ones dropped as stale: a bias against long answers, and their tokens wasted.
Each run's batches.jsonl records per step the response lengths (policy tokens) generated and
dropped as stale since the previous step, and of every trained trajectory its policy tokens
trained and those made context as too old (mask_stale_tokens); this report reads them:

    generated   every trajectory handed in valid
    dropped     those dropped as stale
    trained     those trained, at their generated length (trained + masked tokens)

and prints one row per run (drop rate, mean and median length of each, the share of trained
trajectories' tokens masked, the share of generated tokens never trained (dropped or masked),
the mean reward trained and the last eval accuracy), then draws a PNG: per run, the three
length distributions as histograms and as CDFs. Trajectories still queued when the run ended
count as generated, neither dropped nor trained.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_fr.analysis.run_files import BATCHES_FILE, has_accuracy, read_metrics, read_run_log

PLOT_FILE = "lengths.png"
KINDS = ("generated", "dropped", "trained")
COLORS = {"generated": "tab:blue", "dropped": "tab:red", "trained": "tab:green"}
"""One colour per kind in every panel, whichever kinds a run has."""


@dataclass(frozen=True)
class RunLengths:
    """One run's response lengths over the steps read (policy tokens as generated)."""

    generated: list[int]
    dropped: list[int]
    trained: list[int]
    masked_tokens: int
    """Policy tokens of trained trajectories made context as too old."""
    reward_mean: float
    """Mean reward of the trained trajectories."""
    accuracy: float | None
    """The last complete evaluation's accuracy (None: the run has none)."""

    @property
    def drop_rate(self) -> float:
        return len(self.dropped) / len(self.generated) if self.generated else math.nan

    @property
    def masked_share(self) -> float:
        """Masked tokens / policy tokens of the trained trajectories as generated."""
        total = sum(self.trained)
        return self.masked_tokens / total if total else math.nan

    @property
    def untrained_share(self) -> float:
        """Policy tokens generated for nothing, dropped or masked, / policy tokens generated:
        what either rule costs in generation."""
        total = sum(self.generated)
        return (sum(self.dropped) + self.masked_tokens) / total if total else math.nan

    def of(self, kind: str) -> list[int]:
        return {"generated": self.generated, "dropped": self.dropped, "trained": self.trained}[kind]


def run_lengths(
    batches: Sequence[dict], metrics: Sequence[dict] = (), from_step: int = 1
) -> RunLengths:
    """The lengths of the batches.jsonl records with step >= from_step; `metrics` (the run's
    metrics.jsonl) gives the accuracy. ValueError when none is left or a record predates the
    length fields."""
    chosen = [b for b in batches if b["step"] >= from_step]
    if not chosen:
        raise ValueError(f"no batch at step >= {from_step}")
    generated: list[int] = []
    dropped: list[int] = []
    trained: list[int] = []
    rewards: list[float] = []
    masked = 0
    for record in chosen:
        if "generated_lengths" not in record:
            raise ValueError(
                f"step {record['step']}: batches.jsonl has no length fields "
                "(the run predates their logging)"
            )
        generated += record["generated_lengths"]
        dropped += record["dropped_stale_lengths"]
        stale = record["stale_tokens_masked"]
        trained += [n + m for n, m in zip(record["response_lengths"], stale, strict=True)]
        masked += sum(stale)
        rewards += record["rewards"]
    evals = [m for m in metrics if has_accuracy(m)]
    return RunLengths(
        generated,
        dropped,
        trained,
        masked,
        statistics.fmean(rewards),
        evals[-1]["eval_accuracy"] if evals else None,
    )


def _mean_median(values: list[int]) -> str:
    if not values:
        return "-"
    return f"{statistics.fmean(values):.1f} / {statistics.median(values):g}"


def table(rows: Sequence[tuple[str, RunLengths]]) -> str:
    """Markdown: one row per run."""
    lines = [
        "| run | generated | dropped as stale | drop rate | length generated (mean / median) "
        "| length dropped | length trained | tokens masked | tokens not trained "
        "| reward trained | accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        accuracy = "-" if r.accuracy is None else f"{r.accuracy:.3f}"
        lines.append(
            f"| {name} | {len(r.generated)} | {len(r.dropped)} | {r.drop_rate:.1%} "
            f"| {_mean_median(r.generated)} | {_mean_median(r.dropped)} "
            f"| {_mean_median(r.trained)} | {r.masked_share:.1%} | {r.untrained_share:.1%} "
            f"| {r.reward_mean:.3f} "
            f"| {accuracy} |"
        )
    return "\n".join(lines)


def plot(rows: Sequence[tuple[str, RunLengths]], out: Path) -> Path:
    """Per run a column: the length histograms (density) above, the CDFs below."""
    fig = Figure(figsize=(5 * len(rows), 7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(rows), squeeze=False)
    for col, (name, r) in enumerate(rows):
        top = max(max(r.of(kind), default=0) for kind in KINDS)
        bins = np.linspace(0, max(top, 1), 31)
        hist, cdf = axes[0][col], axes[1][col]
        for kind in KINDS:
            values = np.sort(np.asarray(r.of(kind), dtype=float))
            if not values.size:
                continue
            label = f"{kind} ({values.size})"
            color = COLORS[kind]
            hist.hist(values, bins=bins, density=True, histtype="step", color=color, label=label)
            fractions = np.arange(1, values.size + 1) / values.size
            cdf.step(values, fractions, where="post", color=color, label=label)
        hist.set_title(f"{name}: drop rate {r.drop_rate:.1%}", fontsize="small")
        hist.set_xlabel("response length (policy tokens)")
        hist.set_ylabel("density")
        cdf.set_xlabel("response length (policy tokens)")
        cdf.set_ylabel("CDF")
        for ax in (hist, cdf):
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__  # what the columns mean
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with batches.jsonl)"
    )
    parser.add_argument(
        "--from-step", type=int, default=1, help="first step counted (default 1: all)"
    )
    parser.add_argument(
        "--names",
        help="comma-separated names of the runs in the table and plot (default: the paths)",
    )
    parser.add_argument(
        "--out", metavar="FILE", help=f"PNG to write (default FIRST_RUN_DIR/{PLOT_FILE})"
    )


def main(args: argparse.Namespace) -> int:
    """Prints the table and the PNG's path; exit code 2 (the reason on stderr) when a run has
    no usable batches.jsonl."""
    names = args.names.split(",") if args.names else list(args.run_dirs)
    if len(names) != len(args.run_dirs):
        print("megatron-fr lengths: error: --names needs one name per run", file=sys.stderr)
        return 2
    try:
        rows = [
            (name, run_lengths(read_run_log(d, BATCHES_FILE), read_metrics(d), args.from_step))
            for name, d in zip(names, args.run_dirs, strict=True)
        ]
    except (OSError, ValueError) as error:
        print(f"megatron-fr lengths: error: {error}", file=sys.stderr)
        return 2
    print(table(rows))
    print(plot(rows, Path(args.out or Path(args.run_dirs[0]) / PLOT_FILE)))
    return 0
