"""Sample efficiency and lag stability, measured: the paper's two claims at the demo's scale.

    megatron-fr compare methods RECIPE --out DIR [--seeds 8] [--steps N] [--estimators E,..]
                                       [--lrs 1e-4,3e-4,1e-3 --selection-seeds 2]
                                       [--x trained|generated|tokens] [--jobs 2]
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

With --lrs each configuration first runs every learning rate on --selection-seeds seeds of
its own (1000 and up, DIR/<configuration>-lr<lr>-select<s>) and is then compared at the one
with the highest --select-by score (final held-out accuracy, or the mean over the budget): a
method is compared at its best, and the choice is not fitted to the seeds it is judged on
(choose_learning_rates). A rate at either end of the grid is not shown to be the best (the
score may still rise past it), so the comparison stops there, writes the sweep to
DIR/sweep.md and asks for a wider grid (GridEdgeError); --allow-grid-edge compares anyway and
marks that rate as an edge in the tables. --sweep-only stops after the sweep (its table in
DIR/sweep.md, edges marked), to look at it before the compared runs are trained.

--jobs N trains N runs at once (an interrupted comparison keeps every run that finished).
A run that already finished is read, not trained again, so an interrupted comparison is
continued by the same command; one whose config.yaml names another starting model than the
recipe's is refused (OtherModelError), and results.md lists the commits the runs were trained
at. Results (compare_report.py, compare_stats.py): DIR/results.md
(per configuration its learning rate, final held-out accuracy as mean +- sample std with the
t interval of the mean, the mean accuracy over the budget with a bootstrap interval, mean
acceptance, KL and lag; for `methods`, the budget each configuration needs to reach the first
group estimator's final accuracy on isotonic fits of the mean curves, as a share of that
estimator's budget with a paired bootstrap interval, and a table of the accuracy gap at each
budget; the sweep's table), DIR/accuracy.png (accuracy against the --x budget, mean over seeds
with the sample std as a band and the isotonic fit dashed) and DIR/results.json. Against
generated rollouts or tokens no two runs evaluate at the same budget; their curves are
interpolated onto one grid first (compare_stats.aligned).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from megatron_fr.analysis import compare_reader as reader
from megatron_fr.analysis import compare_report as report
from megatron_fr.analysis import compare_stats as stats
from megatron_fr.analysis.axes import BUDGETS
from megatron_fr.config.algo import FlashReinforceConfig
from megatron_fr.config.buffer import MAX_LAG
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.run import load_run_config
from megatron_fr.utils.provenance import run_provenance

GATES: tuple[str, ...] = get_args(FlashReinforceConfig.model_fields["gate_kl"].annotation)
"""learner.flash_reinforce.gate_kl's values: what `compare lag --gates` takes."""
ESTIMATORS: tuple[str, ...] = get_args(LearnerConfig.model_fields["estimator"].annotation)
"""learner.estimator's values: what `compare --estimators` takes."""
SELECTION_SEED = 1000
"""The first seed of the learning-rate sweep's selection runs (choose_learning_rates)."""
MAX_SEEDS = 1000
"""More seeds than this is a typo, not a comparison: each seed is a whole training run."""
MAX_STEPS = 10**7
MAX_GROUP_SIZE = 4096


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]


def gate_list(text: str) -> tuple[str, ...]:
    """--gates: a comma-separated subset of GATES, in the order given."""
    gates = tuple(dict.fromkeys(gate for gate in text.split(",") if gate))
    if not gates or any(gate not in GATES for gate in gates):
        raise argparse.ArgumentTypeError(
            f"takes a comma-separated subset of {','.join(GATES)}, got {text[:40]!r}"
        )
    return gates


def learning_rates(text: str) -> tuple[float, ...]:
    """--lrs: comma-separated positive learning rates, in the order given."""
    try:
        values = tuple(dict.fromkeys(float(item) for item in text.split(",") if item))
    except ValueError:
        values = ()
    if not values or any(not 0 < value < 1 for value in values):
        raise argparse.ArgumentTypeError(
            "takes comma-separated learning rates in (0, 1), e.g. 1e-4,3e-4,1e-3; "
            f"got {text[:40]!r}"
        )
    return values


def positive_int(text: str) -> int:
    """--jobs: an integer of at least 1."""
    return bounded_int(1, 1024)(text)


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`, written in digits (argparse's
    `int` would take '٣' and ' 3'; a count out of range failed later, as a TypeError or in
    a training run, instead of here)."""

    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit()) or not low <= int(text[:12]) <= high:
            raise argparse.ArgumentTypeError(
                f"takes a whole number from {low} to {high}, got {text[:40]!r}"
            )
        return int(text)

    return parse


def lag_list(text: str) -> tuple[int, ...]:
    """--lags: comma-separated max_lag values, each 0 to buffer.max_lag's bound."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items or not all(i.isascii() and i.isdigit() and int(i[:12]) <= MAX_LAG for i in items):
        raise argparse.ArgumentTypeError(
            f"takes comma-separated whole numbers from 0 to {MAX_LAG}, e.g. 0,2,8; "
            f"got {text[:40]!r}"
        )
    return tuple(dict.fromkeys(int(item) for item in items))


def estimator_list(text: str) -> tuple[str, ...]:
    """--estimators: a comma-separated subset of learner.estimator's values, in order."""
    items = tuple(dict.fromkeys(item.strip() for item in text.split(",") if item.strip()))
    unknown = [item for item in items if item not in ESTIMATORS]
    if not items or unknown:
        shown = repr(unknown[0][:40]) if unknown else "nothing"
        raise argparse.ArgumentTypeError(
            f"takes a comma-separated subset of {','.join(ESTIMATORS)}; got {shown}"
        )
    return items


def out_dir(text: str) -> Path:
    """--out: a directory, or a path where one can be made: not a file, not under one."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"takes a directory path, got {text[:40]!r}")
    path = Path(text)
    for place in (path, *path.parents):
        if os.path.lexists(place) and not place.is_dir():
            what = "is" if place == path else f"is under {place}, which is"
            raise argparse.ArgumentTypeError(f"{text} {what} not a directory")
        if place.is_dir():
            break
    return path


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
    """Whether the run logged its last step's evaluation, complete or not: it ran to its end
    (compare_reader.RunDirError when its metrics are malformed)."""
    return reader.state(run_dir, steps) == "finished"


def variants_for(args: argparse.Namespace, batch_size: int) -> list[Variant]:
    default = ["flash_reinforce", "grpo", "rloo"] if args.mode == "methods" else ["flash_reinforce"]
    estimators = list(args.estimators) if args.estimators else default
    if args.mode == "methods":
        return method_variants(estimators, args.group_size)
    return lag_variants(estimators, list(args.lags), batch_size, args.group_size, args.gates)


def check_variants(recipe: Path, overrides: list[str], variants: list[Variant]) -> None:
    """Every run's settings load as a recipe before any run is trained: a setting the recipe
    refuses (a group size that does not divide the batch, a max_lag past its bound) is one
    line naming the configuration and the key, not a failed training run part-way through."""
    for variant in variants:
        try:
            load_run_config(recipe, [*overrides, *variant.overrides])
        except ValueError as error:
            raise ValueError(f"configuration {variant.name}: {error}") from None


def run(args: argparse.Namespace) -> int:
    """The comparison; a bad recipe, setting or run directory, or a run that fails, ends it
    with one line on stderr (exit 2), never a traceback."""
    try:
        return _compare(args)
    except (ValueError, OSError, OtherModelError, GridEdgeError) as error:
        print(f"megatron-fr compare: error: {error}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as error:
        print(
            f"megatron-fr compare: error: a training run failed (exit {error.returncode}; its "
            f"error is above): {' '.join(str(part) for part in error.cmd[4:])}",
            file=sys.stderr,
        )
        return 2


def _compare(args: argparse.Namespace) -> int:
    if args.mode == "methods" and args.gates != ("bernoulli",):
        raise ValueError(
            "--gates applies to `compare lag` (methods compares estimators with the "
            "recipe's gate; set learner.flash_reinforce.gate_kl to change it)"
        )
    if args.sweep_only and not args.lrs:
        raise ValueError("--sweep-only needs --lrs (the grid to sweep)")
    out: Path = args.out
    overrides = [item for item in args.overrides if item != "--"]
    if args.steps:
        overrides.append(f"steps={args.steps}")
    config = load_run_config(args.recipe, overrides)
    provenance = run_provenance(config.model.hf_dir)
    runs = Runs(
        args.recipe,
        out,
        overrides,
        config.steps,
        config.buffer.batch_size,
        provenance["model_sha256"],
        args.jobs,
    )
    variants = variants_for(args, config.buffer.batch_size)
    check_variants(args.recipe, overrides, variants)
    out.mkdir(parents=True, exist_ok=True)
    scores, chosen = choose_learning_rates(
        runs, variants, args.lrs, args.selection_seeds, SELECT_BY[args.select_by]
    )
    edges = grid_edges(chosen, args.lrs) if args.lrs else {}
    sweep = report.sweep_table(scores, chosen, edges) if scores else ""
    if sweep:
        (out / "sweep.md").write_text(f"{_sweep_title(args)}\n\n{sweep}")
    if args.sweep_only:
        print(f"{_sweep_title(args)}\n\n{sweep}")
        return 0
    if not args.allow_grid_edge:
        refuse_grid_edges(edges, chosen, out / "sweep.md")
    # Seed-major, so that an interrupted comparison already covers every configuration.
    planned = [
        PlannedRun(variant, f"{variant.name}-seed{seed}", seed, chosen.get(variant.name))
        for seed in range(args.seeds)
        for variant in variants
    ]
    by_variant: dict[str, list[report.RunSummary]] = {v.name: [] for v in variants}
    for summary in runs.summaries(planned):
        by_variant[summary.variant].append(summary)
    reference = _reference(variants) if args.mode == "methods" else None
    started_from = "; ".join(f"{key}: {value}" for key, value in provenance.items())
    trained_at = ", ".join(f"{commit} ({n})" for commit, n in sorted(runs.commits.items()))
    table = f"Started from {started_from}.\nRuns trained at (commit (runs)): {trained_at}.\n\n"
    table += report.results_table(by_variant, reference, args.x)
    if reference:
        table += f"\nAccuracy minus {reference}'s at each budget:\n\n"
        table += report.gap_table(by_variant, reference, args.x)
    tools = report.tool_table(by_variant)
    if tools:
        table += f"\nTool use (share of trajectories with a call below {report.STOPPED_CALLING} "
        table += f"over the last {report.TOOL_WINDOW} steps: stopped):\n\n{tools}"
    if sweep:
        table += f"\n{_sweep_title(args)}\n\n{sweep}"
    (out / "results.md").write_text(table)
    results = {name: [run.__dict__ for run in runs] for name, runs in by_variant.items()}
    (out / "results.json").write_text(json.dumps({"runs": results, "sweep": scores}, indent=1))
    report.plot(by_variant, out / "accuracy.png", f"{args.mode}: {args.recipe.name}", args.x)
    print(table)
    return 0


class OtherModelError(Exception):
    """A finished run in the comparison's directory was trained from another starting model."""


class GridEdgeError(Exception):
    """A configuration's best learning rate of the sweep is the grid's lowest or highest."""


SELECT_BY = {"final": stats.final_accuracy, "mean": stats.area_under_curve}
"""--select-by: the score a learning rate is chosen by, over its selection seeds' curves:
the final held-out accuracy (mean over seeds), or the mean accuracy over the budget."""


def grid_edges(chosen: dict[str, float], lrs: tuple[float, ...]) -> dict[str, str]:
    """{configuration: "lowest" | "highest"} for each chosen rate at an end of the grid (a
    grid of one rate is both ends: nothing was shown)."""
    edges = {}
    for name, lr in chosen.items():
        if lr == min(lrs):
            edges[name] = "lowest"
        elif lr == max(lrs):
            edges[name] = "highest"
    return edges


def refuse_grid_edges(edges: dict[str, str], chosen: dict[str, float], sweep: Path) -> None:
    """GridEdgeError naming every configuration whose best rate is at an edge, and which way
    to widen the grid."""
    if not edges:
        return
    named = "; ".join(
        f"{name}'s best is {chosen[name]:g}, the grid's {end} (add rates "
        f"{'below' if end == 'lowest' else 'above'} it)"
        for name, end in edges.items()
    )
    raise GridEdgeError(
        f"{named}: a rate at the grid's edge is not shown to be the best, so nothing is "
        f"compared. Widen the grid (--lrs); the sweep so far is in {sweep} "
        "(--allow-grid-edge compares at the edge anyway)."
    )


@dataclass(frozen=True)
class PlannedRun:
    """One run of the comparison: `variant` at `seed` (and `lr`, None: the recipe's), in
    DIR/`name`."""

    variant: Variant
    name: str
    seed: int
    lr: float | None


class Runs:
    """Trains (or reads back) the comparison's runs, each in its own directory of `out`,
    `jobs` at a time."""

    def __init__(
        self,
        recipe: Path,
        out: Path,
        overrides: list[str],
        steps: int,
        batch_size: int,
        model_hash: str | None,
        jobs: int = 1,
    ) -> None:
        self.recipe, self.out, self.overrides = recipe, out, overrides
        self.steps, self.batch_size, self.model_hash = steps, batch_size, model_hash
        self.jobs = jobs
        self.commits: Counter[str] = Counter()
        """How many of the runs read were trained at each commit (their config.yaml header)."""

    def summaries(self, planned: list[PlannedRun]) -> list[report.RunSummary]:
        """Each planned run's summary, in order: the finished ones read back (if they started
        from the recipe's model, OtherModelError otherwise, before anything is trained), the
        others trained first, `jobs` at a time (the first failure stops the comparison)."""
        todo = []
        for run in planned:
            if finished(self.out / run.name, self.steps):
                read = reader.read_finished(self.out / run.name, self.steps)
                self._check_same_model(self.out / run.name, read.header)
            else:
                todo.append(run)
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            list(pool.map(self._train, todo))  # raises the first run's failure
        summaries = []
        for run in planned:
            run_dir = self.out / run.name
            read = reader.read_finished(run_dir, self.steps)
            self.commits[read.header.get("commit", "unknown")] += 1
            summary = report.summarise(
                run.variant.name, run.seed, run_dir, self.batch_size, run.lr, read.records
            )
            summaries.append(summary)
        return summaries

    def _train(self, run: PlannedRun) -> None:
        settings = [*self.overrides, *run.variant.overrides, f"seed={run.seed}"]
        settings += [f"learner.lr={run.lr}"] if run.lr is not None else []
        command = train_command(self.recipe, self.out / run.name, settings)
        print("$ " + " ".join(command), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)

    def _check_same_model(self, run_dir: Path, header: dict[str, str]) -> None:
        """A finished run is reused only if it started from the model every new run will start
        from: a comparison resumed after the model was made again (another machine, another
        warm start) would otherwise mix two starting models in one table."""
        recorded = header.get("model_sha256")
        if recorded and self.model_hash and recorded != self.model_hash:
            raise OtherModelError(
                f"{run_dir} was trained from the model with sha256 {recorded}, but the "
                f"recipe's model is now {self.model_hash}: the comparison would mix two "
                "starting models. Move that directory (or the whole --out) aside to train "
                "it again, or bring back the model it started from."
            )


def _sweep_title(args: argparse.Namespace) -> str:
    what = {"final": "final held-out accuracy", "mean": "mean accuracy over the budget"}
    last = SELECTION_SEED + args.selection_seeds - 1
    return (
        f"Learning rates ({what[args.select_by]}, mean of selection seeds {SELECTION_SEED}-{last}):"
    )


def choose_learning_rates(
    runs: Runs,
    variants: list[Variant],
    lrs: tuple[float, ...],
    seeds: int,
    score: Callable[[list[stats.Curve]], float] = stats.final_accuracy,
) -> tuple[dict[str, dict[float, float]], dict[str, float]]:
    """Each configuration's best learning rate of `lrs`: the highest `score` of its curves
    (trained rollouts) on `seeds` selection seeds, SELECTION_SEED and up, which the
    comparison's own seeds (0 and up) never use, so the choice is not fitted to the seeds it
    is judged on. ({name: {lr: score}}, {name: chosen lr}); both empty without `lrs`."""
    selection = range(SELECTION_SEED, SELECTION_SEED + seeds)
    # Seed-major: an interrupted sweep already has the whole grid on its first seeds.
    planned = [
        PlannedRun(variant, f"{variant.name}-lr{lr:g}-select{seed}", seed, lr)
        for seed in selection
        for lr in lrs
        for variant in variants
    ]
    curves: dict[tuple[str, float], list[stats.Curve]] = {}
    for run, summary in zip(planned, runs.summaries(planned), strict=True):
        curves.setdefault((run.variant.name, run.lr or 0.0), []).append(summary.curve)
    scores: dict[str, dict[float, float]] = {}
    for variant in variants:
        for lr in lrs:
            scores.setdefault(variant.name, {})[lr] = score(curves[variant.name, lr])
    chosen = {name: max(by_lr, key=lambda lr: by_lr[lr]) for name, by_lr in scores.items()}
    return scores, chosen


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
    parser.add_argument("--out", type=out_dir, required=True, help="directory of runs and results")
    parser.add_argument(
        "--seeds", type=bounded_int(1, MAX_SEEDS), default=8, help="seeds per configuration"
    )
    parser.add_argument(
        "--steps",
        type=bounded_int(0, MAX_STEPS),
        default=0,
        help="optimizer steps (0: the recipe's)",
    )
    parser.add_argument(
        "--estimators",
        type=estimator_list,
        default=(),
        help="comma-separated: flash_reinforce, grpo, dr_grpo, rloo, "
        "reinforce_baseline (default: methods flash_reinforce,grpo,rloo; "
        "lag flash_reinforce)",
    )
    parser.add_argument(
        "--lags", type=lag_list, default=(0, 2, 8), help="lag mode: the max_lag values"
    )
    parser.add_argument(
        "--gates",
        type=gate_list,
        default=("bernoulli",),
        help="lag mode: FlashREINFORCE's trust-region gates, comma-separated: "
        "bernoulli (the paper's; the run keeps its name), topk (the "
        "optional top-K gate; its runs end in _topk)",
    )
    parser.add_argument(
        "--group-size",
        type=bounded_int(2, MAX_GROUP_SIZE),
        default=4,
        help="G of the group estimators",
    )
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=1,
        help="runs trained at once (on a 2-core machine one CPU run, bound by its engine, "
        "leaves about a third of the cores idle)",
    )
    parser.add_argument(
        "--lrs",
        type=learning_rates,
        default=(),
        help="comma-separated learning rates: each configuration runs at its best of them, "
        "chosen on separate seeds (--selection-seeds); default: the recipe's learning rate",
    )
    parser.add_argument(
        "--selection-seeds",
        type=bounded_int(1, MAX_SEEDS),
        default=2,
        help=f"seeds per learning rate of the sweep ({SELECTION_SEED} and up)",
    )
    parser.add_argument(
        "--select-by",
        choices=tuple(SELECT_BY),
        default="final",
        help="the sweep's score: final held-out accuracy, or the mean over the budget",
    )
    parser.add_argument(
        "--sweep-only",
        action="store_true",
        help="train (or read) the learning-rate sweep only, write DIR/sweep.md and stop",
    )
    parser.add_argument(
        "--allow-grid-edge",
        action="store_true",
        help="compare at a best rate at the grid's edge (refused by default: widen the grid)",
    )
    parser.add_argument(
        "--x",
        choices=BUDGETS,
        default="trained",
        help="the budget the results are read against: trained rollouts, generated rollouts "
        "(discarded groups and stale drops charged) or trained response tokens",
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value for every run")
