"""Sample efficiency and lag stability, measured: the paper's two claims at the demo's scale.

    megatron-fr compare methods RECIPE --out DIR [--seeds 3] [--steps N] [--estimators E,..]
    megatron-fr compare lag RECIPE --out DIR [--estimators flash_reinforce,grpo] [--lags 0,8]
                                             [--gates bernoulli,topk]
    (then dotted.key=value overrides for every run)

`methods` trains FlashREINFORCE (one rollout per problem) and the group estimators (GRPO, RLOO
by default; G rollouts per problem) with the same batch size B and number of steps, so the
same number of trained rollouts (B per step): FlashREINFORCE sees B problems a step, the group
methods B / G. Each (configuration, seed) is one `megatron-fr train` run in
DIR/<configuration>-seed<s>; all start from the recipe's model (model.hf_dir), so they differ
only in how they use their rollouts. `lag` trains every (estimator, max_lag) pair through the
same lag-aware buffer, each at exactly its max_lag (lag_variants), and FlashREINFORCE also
without the gate (delta = inf) at the largest lag; with --gates, FlashREINFORCE runs at each lag
once per trust-region gate (learner.flash_reinforce.gate_kl: the paper's bernoulli keeps its
name, the optional topk adds "_topk").

A run that already finished is read, not trained again, so an interrupted comparison is
continued by the same command. Results: DIR/results.md (final held-out accuracy, mean +- std
over seeds and its 95% bootstrap interval; mean acceptance, KL and lag; for `methods`, the
rollouts each configuration needs to reach the first group estimator's final accuracy, as a
share of that estimator's budget with its 95% bootstrap interval: compare_stats.py),
DIR/accuracy.png (accuracy against trained rollouts, mean over seeds with the spread as a
band) and DIR/results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from megatron_fr.config.algo import FlashReinforceConfig
from megatron_fr.config.run import load_run_config
from megatron_fr.orchestrator import compare_stats as stats
from megatron_fr.orchestrator.run_log import has_accuracy, read_metrics
from megatron_fr.utils.provenance import run_provenance

GATES: tuple[str, ...] = get_args(FlashReinforceConfig.model_fields["gate_kl"].annotation)
"""learner.flash_reinforce.gate_kl's values: what `compare lag --gates` takes."""


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def gate_list(text: str) -> tuple[str, ...]:
    """--gates: a comma-separated subset of GATES, in the order given."""
    gates = tuple(dict.fromkeys(gate for gate in text.split(",") if gate))
    if not gates or any(gate not in GATES for gate in gates):
        raise argparse.ArgumentTypeError(
            f"takes a comma-separated subset of {','.join(GATES)}, got {text!r}"
        )
    return gates


def gated(variant: Variant, gate: str) -> Variant:
    """`variant` with FlashREINFORCE's gate set to `gate`: bernoulli (the default) keeps the
    name and the settings; topk adds "_topk" and learner.flash_reinforce.gate_kl=topk."""
    if gate == "bernoulli":
        return variant
    return Variant(
        f"{variant.name}_{gate}", (*variant.overrides, f"learner.flash_reinforce.gate_kl={gate}")
    )


def estimator_variant(estimator: str, group_size: int) -> Variant:
    """A run of `estimator` with its own loss: FlashREINFORCE one rollout per problem, the
    group estimators G rollouts per problem (the same B, so the same trained rollouts)."""
    if estimator == "flash_reinforce":
        return Variant(estimator, ("learner.estimator=flash_reinforce", "buffer.group_size=1"))
    overrides = (f"learner.estimator={estimator}", f"buffer.group_size={group_size}")
    return Variant(f"{estimator}_g{group_size}", overrides)


def method_variants(estimators: list[str], group_size: int) -> list[Variant]:
    return [estimator_variant(estimator, group_size) for estimator in estimators]


def lag_variants(
    estimators: list[str],
    lags: list[int],
    batch_size: int,
    group_size: int,
    gates: tuple[str, ...] = ("bernoulli",),
) -> list[Variant]:
    """Every (estimator, lag) pair, each run at exactly its max_lag (buffer.fill_staleness_budget,
    with the capacity that needs): where generation is slower than the learner, as on a CPU
    machine, the lag would otherwise stay near 1 whatever max_lag allows, and the sweep would
    compare nothing. FlashREINFORCE runs once per gate of `gates` at each lag (the group
    estimators have no gate), and also ungated (delta = inf) at the largest lag."""

    def at_lag(lag: int) -> tuple[str, ...]:
        return (
            f"buffer.max_lag={lag}",
            "buffer.fill_staleness_budget=true",
            f"buffer.capacity={(lag + 1) * batch_size}",
        )

    variants = []
    for estimator in estimators:
        base = estimator_variant(estimator, group_size)
        own = gates if estimator == "flash_reinforce" else ("bernoulli",)
        variants += [
            gated(Variant(f"{base.name}_lag{lag}", base.overrides + at_lag(lag)), gate)
            for lag in lags
            for gate in own
        ]
    if "flash_reinforce" in estimators:
        top = max(lags)
        flash = estimator_variant("flash_reinforce", group_size)
        no_gate = (*flash.overrides, *at_lag(top), "learner.flash_reinforce.delta=.inf")
        variants.append(Variant(f"flash_reinforce_lag{top}_no_gate", no_gate))
    return variants


def train_command(recipe: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    train = [sys.executable, "-m", "megatron_fr", "train", str(recipe)]
    return [*train, "--run-dir", str(run_dir), *overrides]


def finished(run_dir: Path, steps: int) -> bool:
    if not (run_dir / "metrics.jsonl").exists():
        return False
    # the last step's eval line, complete or not: the run ran to its end
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
    evals = {r["step"]: r["eval_accuracy"] for r in records if has_accuracy(r)}
    steps = [r for r in records if "reward_mean" in r]
    kls = [r["sequence_kl_mean"] for r in steps if r.get("sequence_kl_mean") is not None]
    lags = [r["lag_mean"] for r in steps if r.get("lag_mean") is not None]
    return RunSummary(
        variant,
        seed,
        curve=[(step * batch_size, accuracy) for step, accuracy in sorted(evals.items())],
        acceptance=statistics.fmean(r["acceptance_rate"] for r in steps) if steps else 0.0,
        kl=statistics.fmean(kls) if kls else None,
        lag=statistics.fmean(lags) if lags else None,
    )


def results_table(by_variant: dict[str, list[RunSummary]], reference: str | None) -> str:
    """One row per configuration: final accuracy (mean +- std over seeds, and its 95%
    bootstrap interval), mean acceptance, KL and lag; with a reference, the rollouts each
    needs to reach the reference's final accuracy, as a share of the reference's budget with
    its 95% bootstrap interval (compare_stats)."""
    curves = {name: [run.curve for run in runs] for name, runs in by_variant.items()}
    header = (
        "| run | seeds | final accuracy (mean +- std) | 95% interval | mean acceptance "
        "| mean KL | mean lag |"
    )
    if reference:
        header += f" rollouts to reach {reference}'s final (x its budget, 95% interval) |"
    lines = [header, "|" + "---|" * (7 + bool(reference))]
    for name, runs in by_variant.items():
        _, mean, std = stats.mean_curve(curves[name])[-1]
        interval = _interval(stats.bootstrap_interval([curves[name]], stats.final_accuracy))
        kl = _mean_or_na([r.kl for r in runs], "{:.2e}")
        lag = _mean_or_na([r.lag for r in runs], "{:.2f}")
        acceptance = statistics.fmean(r.acceptance for r in runs)
        row = (
            f"| {name} | {len(runs)} | {mean:.3f} +- {std:.3f} | {interval} | "
            f"{acceptance:.3f} | {kl} | {lag} |"
        )
        if reference:
            row += f" {_reach(curves[name], curves[reference])} |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def _reach(curves: list, reference: list) -> str:
    ratio = stats.budget_ratio(curves, reference)
    if ratio is None:
        return "not reached"
    budget = stats.mean_curve(reference)[-1][0]
    interval = _interval(stats.bootstrap_interval([curves, reference], stats.budget_ratio), "x")
    return f"{ratio * budget:,.0f} ({ratio:.2f}x, {interval})"


def _interval(bounds: tuple[float, float] | None, unit: str = "") -> str:
    if bounds is None:
        return "n/a (1 seed)"
    low, high = (f"{b:.3f}{unit}" if b != float("inf") else "not reached" for b in bounds)
    return f"[{low}, {high}]"


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
        curve = stats.mean_curve([run.curve for run in runs])
        xs = [x for x, _, _ in curve]
        means = [m for _, m, _ in curve]
        stds = [s for _, _, s in curve]
        axes.plot(xs, means, marker="o", label=f"{name} ({len(runs)} seeds)")
        axes.fill_between(
            xs,
            [m - s for m, s in zip(means, stds, strict=True)],
            [m + s for m, s in zip(means, stds, strict=True)],
            alpha=0.2,
        )
    axes.set_xlabel("trained rollouts")
    axes.set_ylabel("held-out accuracy")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def variants_for(args: argparse.Namespace, batch_size: int) -> list[Variant]:
    default = ["flash_reinforce", "grpo", "rloo"] if args.mode == "methods" else ["flash_reinforce"]
    estimators = [e for e in args.estimators.split(",") if e] if args.estimators else default
    if args.mode == "methods":
        return method_variants(estimators, args.group_size)
    lags = [int(lag) for lag in args.lags.split(",")]
    return lag_variants(estimators, lags, batch_size, args.group_size, args.gates)


def run(args: argparse.Namespace) -> int:
    if args.mode == "methods" and args.gates != ("bernoulli",):
        print(
            "compare: --gates applies to `compare lag` (methods compares estimators with the "
            "recipe's gate; set learner.flash_reinforce.gate_kl to change it)",
            file=sys.stderr,
        )
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    overrides = [item for item in args.overrides if item != "--"]
    if args.steps:
        overrides.append(f"steps={args.steps}")
    config = load_run_config(args.recipe, overrides)
    variants = variants_for(args, config.buffer.batch_size)
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
    reference = _reference(variants) if args.mode == "methods" else None
    provenance = run_provenance(config.model.hf_dir)
    started_from = "; ".join(f"{key}: {value}" for key, value in provenance.items())
    table = f"Started from {started_from}.\n\n" + results_table(by_variant, reference)
    (out / "results.md").write_text(table)
    results = {name: [run.__dict__ for run in runs] for name, runs in by_variant.items()}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(by_variant, out / "accuracy.png", f"{args.mode}: {args.recipe.name}")
    print(table)
    return 0


def _reference(variants: list[Variant]) -> str | None:
    """The baseline the others are measured against: the first group estimator."""
    return next((v.name for v in variants if v.name != "flash_reinforce"), None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "mode",
        choices=("methods", "lag"),
        help="methods: estimators at equal rollouts; lag: every (estimator, max_lag) pair, "
        "and FlashREINFORCE ungated at the largest lag",
    )
    parser.add_argument("recipe", type=Path, help="the recipe every run starts from")
    parser.add_argument("--out", type=Path, required=True, help="directory of runs and results")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per configuration")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps (0: the recipe's)")
    parser.add_argument(
        "--estimators",
        default="",
        help="comma-separated: flash_reinforce, grpo, dr_grpo, rloo, "
        "reinforce_baseline (default: methods flash_reinforce,grpo,rloo; "
        "lag flash_reinforce)",
    )
    parser.add_argument("--lags", default="0,2,8", help="lag mode: the max_lag values")
    parser.add_argument(
        "--gates",
        type=gate_list,
        default=("bernoulli",),
        help="lag mode: FlashREINFORCE's trust-region gates, comma-separated: "
        "bernoulli (the paper's; the run keeps its name), topk (the "
        "optional top-K gate; its runs end in _topk)",
    )
    parser.add_argument("--group-size", type=int, default=4, help="G of the group estimators")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run")
