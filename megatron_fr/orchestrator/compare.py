"""Sample efficiency and lag stability, measured: the paper's two claims at the demo's scale.

    megatron-fr compare methods RECIPE --out DIR [--seeds 3] [--steps N] [-- overrides]
    megatron-fr compare lag RECIPE --out DIR [--seeds 3] [--steps N] [-- overrides]

`methods` trains FlashREINFORCE (one rollout per problem), GRPO and RLOO (G rollouts per
problem) with the same batch size B and number of steps, so the same number of trained
rollouts (B per step): FlashREINFORCE sees B problems a step, the group methods B / G. Each
(method, seed) is one `megatron-fr train` run in DIR/<method>-seed<s>; all start from the
recipe's model (model.hf_dir), so the methods differ only in how they use their rollouts.
`lag` trains FlashREINFORCE at max_lag 0, 2 and 8 with the recipe's
delta, and at max_lag 8 without the gate (delta = inf), each at exactly its max_lag
(see lag_variants).

A run that already finished is read, not trained again, so an interrupted comparison is
continued by the same command. Results: DIR/results.md (table: final held-out accuracy
mean +- std over seeds, the rollouts each method needs to reach GRPO's final accuracy; for
`lag`: final accuracy, mean acceptance, mean KL, mean lag), DIR/accuracy.png (accuracy against
trained rollouts, mean over seeds with the spread as a band) and DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_fr.config.run import load_run_config
from megatron_fr.orchestrator.run_log import read_metrics


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def method_variants(group_size: int) -> list[Variant]:
    return [
        Variant("flash_reinforce", ("learner.estimator=flash_reinforce", "buffer.group_size=1")),
        Variant(f"grpo_g{group_size}",
                ("learner.estimator=grpo", f"buffer.group_size={group_size}")),
        Variant(f"rloo_g{group_size}",
                ("learner.estimator=rloo", f"buffer.group_size={group_size}")),
    ]  # fmt: skip


def lag_variants(batch_size: int) -> list[Variant]:
    """Every run trains at exactly its max_lag (buffer.fill_staleness_budget, with the capacity
    that needs): where generation is slower than the learner, as on a CPU machine, the lag
    would otherwise stay near 1 whatever max_lag allows, and the sweep would compare nothing."""

    def at_lag(lag: int) -> tuple[str, ...]:
        return (f"buffer.max_lag={lag}", "buffer.fill_staleness_budget=true",
                f"buffer.capacity={(lag + 1) * batch_size}")  # fmt: skip

    return [
        *(Variant(f"lag{lag}", at_lag(lag)) for lag in (0, 2, 8)),
        Variant("lag8_no_gate", (*at_lag(8), "learner.flash_reinforce.delta=.inf")),
    ]


def train_command(recipe: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_fr", "train", str(recipe), "--run-dir", str(run_dir),
            *overrides]  # fmt: skip


def finished(run_dir: Path, steps: int) -> bool:
    if not (run_dir / "metrics.jsonl").exists():
        return False
    return any(r.get("step") == steps and "eval_accuracy" in r for r in read_metrics(run_dir))


@dataclass(frozen=True)
class RunSummary:
    variant: str
    seed: int
    curve: list[tuple[int, float]]
    """(trained rollouts, held-out accuracy) at each evaluation."""
    acceptance: float
    kl: float | None
    lag: float | None
    """Mean over steps of the batch's mean lag (versions between its oldest token and the
    learner)."""


def summarise(variant: str, seed: int, run_dir: Path, batch_size: int) -> RunSummary:
    records = read_metrics(run_dir)
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    steps = [r for r in records if "reward_mean" in r]
    kls = [r["sequence_kl_mean"] for r in steps if r.get("sequence_kl_mean") is not None]
    lags = [r["lag_mean"] for r in steps if r.get("lag_mean") is not None]
    return RunSummary(
        variant, seed,
        curve=[(step * batch_size, accuracy) for step, accuracy in sorted(evals.items())],
        acceptance=statistics.fmean(r["acceptance_rate"] for r in steps) if steps else 0.0,
        kl=statistics.fmean(kls) if kls else None,
        lag=statistics.fmean(lags) if lags else None,
    )  # fmt: skip


def mean_curve(runs: list[RunSummary]) -> list[tuple[int, float, float]]:
    """(rollouts, mean, std over seeds) at the evaluation points all seeds share."""
    shared = set.intersection(*({x for x, _ in run.curve} for run in runs))
    out = []
    for x in sorted(shared):
        values = [dict(run.curve)[x] for run in runs]
        out.append((x, statistics.fmean(values), statistics.pstdev(values)))
    return out


def rollouts_to_reach(curve: list[tuple[int, float, float]], target: float) -> int | None:
    """The first evaluation point whose mean accuracy reaches `target` (None: never)."""
    return next((x for x, mean, _ in curve if mean >= target), None)


def results_table(by_variant: dict[str, list[RunSummary]], reference: str | None) -> str:
    curves = {name: mean_curve(runs) for name, runs in by_variant.items()}
    target = curves[reference][-1][1] if reference else None
    header = "| run | seeds | final accuracy (mean +- std) | mean acceptance | mean KL | mean lag |"
    lines = [header + (f" rollouts to reach {reference}'s final |" if reference else "")]
    lines.append("|" + "---|" * (6 + bool(reference)))
    for name, runs in by_variant.items():
        x, mean, std = curves[name][-1]
        kl = _mean_or_na([r.kl for r in runs], "{:.2e}")
        lag = _mean_or_na([r.lag for r in runs], "{:.2f}")
        acceptance = statistics.fmean(r.acceptance for r in runs)
        accuracy = f"{mean:.3f} +- {std:.3f}"
        row = f"| {name} | {len(runs)} | {accuracy} | {acceptance:.3f} | {kl} | {lag} |"
        if reference:
            reach = rollouts_to_reach(curves[name], target)
            ratio = f" ({reach / x:.2f}x of {x})" if reach else ""
            row += f" {reach if reach is not None else 'not reached'}{ratio} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _mean_or_na(values: list[float | None], form: str) -> str:
    present = [v for v in values if v is not None]
    return form.format(statistics.fmean(present)) if present else "n/a"


def plot(by_variant: dict[str, list[RunSummary]], out: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, runs in by_variant.items():
        curve = mean_curve(runs)
        xs = [x for x, _, _ in curve]
        means = [m for _, m, _ in curve]
        stds = [s for _, _, s in curve]
        axes.plot(xs, means, marker="o", label=f"{name} ({len(runs)} seeds)")
        axes.fill_between(xs, [m - s for m, s in zip(means, stds, strict=True)],
                          [m + s for m, s in zip(means, stds, strict=True)], alpha=0.2)  # fmt: skip
    axes.set_xlabel("trained rollouts")
    axes.set_ylabel("held-out accuracy")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def run(args: argparse.Namespace) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    overrides = [item for item in args.overrides if item != "--"]
    if args.steps:
        overrides.append(f"steps={args.steps}")
    config = load_run_config(args.recipe, overrides)
    if args.mode == "methods":
        variants = method_variants(args.group_size)
    else:
        variants = lag_variants(config.buffer.batch_size)
    by_variant: dict[str, list[RunSummary]] = {variant.name: [] for variant in variants}
    # Seed-major, so that an interrupted comparison already covers every configuration.
    for seed in range(args.seeds):
        for variant in variants:
            run_dir = out / f"{variant.name}-seed{seed}"
            settings = [*overrides, *variant.overrides, f"seed={seed}"]
            if not finished(run_dir, config.steps):
                command = train_command(args.recipe, run_dir, settings)
                print("$ " + " ".join(command), flush=True)
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            summary = summarise(variant.name, seed, run_dir, config.buffer.batch_size)
            by_variant[variant.name].append(summary)
    reference = variants[1].name if args.mode == "methods" else None
    table = results_table(by_variant, reference)
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(
        {name: [run.__dict__ for run in runs] for name, runs in by_variant.items()}, indent=1
    ))  # fmt: skip
    plot(by_variant, out / "accuracy.png", f"{args.mode}: {args.recipe.name}")
    print(table)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("mode", choices=("methods", "lag"),
                        help="methods: FlashREINFORCE vs GRPO vs RLOO; lag: max_lag 0/2/8 and "
                             "no gate at 8")  # fmt: skip
    parser.add_argument("recipe", type=Path, help="the recipe every run starts from")
    parser.add_argument("--out", type=Path, required=True, help="directory of runs and results")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (0: the recipe's)")
    parser.add_argument("--group-size", type=int, default=4, help="G of GRPO and RLOO")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run")
