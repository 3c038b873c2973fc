"""Size a megatron-fr cluster run before launching it (tools/simulate_run.py).

Three modes:
  (default)            FlashREINFORCE (asynchronous, one rollout per prompt) against synchronous
                       GRPO (G rollouts per prompt, lag 0) on the configured cluster, or at each
                       --nodes total (split by --rollout-fraction); a table, and a PNG with --plot
  --suggest            the rollout/learner split of each --nodes total for FlashREINFORCE at
                       --target-lag, and why
  --validate RUN_DIR   predict a finished run's lag histogram and drop share from its own
                       step and sync times, next to what it measured
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_fr.sim.config import SimConfig, field_help, load_sim_config
from megatron_fr.sim.engine import SCHEMES, SimulationStalled
from megatron_fr.sim.plot import plot_suggestion, plot_sweep
from megatron_fr.sim.result import format_table, simulate
from megatron_fr.sim.sweep import suggest, sweep
from megatron_fr.sim.validate import format_validation, validate_run

BAD_INPUT = 2
EXAMPLES = """examples:
  tools/simulate_run.py --nodes 4 8 16 32 64 --plot sweep.png
  tools/simulate_run.py --suggest --nodes 16 --target-lag 8 lengths.median_tokens=4096
  tools/simulate_run.py --config my_cluster.yaml server.peak_tokens_per_s=9000 --json out.json
  tools/simulate_run.py --validate runs/cpu_demo lengths.prompt_tokens=7 \\
      server.single_stream_tokens_per_s=50 server.peak_tokens_per_s=50 \\
      server.max_running_requests=32       # the CPU engine: no batching, 32 threads

settings (dotted.key=value on the command line, or nested keys in --config YAML):
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="simulate_run.py",
        description=__doc__,
        epilog=EXAMPLES + "\n".join(field_help()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", metavar="YAML", help="settings file (keys as listed below)")
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        metavar="N",
        help="total nodes (rollout + learner) to simulate; default: the configured cluster",
    )
    parser.add_argument(
        "--rollout-fraction",
        type=float,
        default=0.5,
        help="share of --nodes given to rollout (default 0.5)",
    )
    parser.add_argument(
        "--suggest",
        action="store_true",
        help="choose the rollout/learner split of each --nodes total",
    )
    parser.add_argument(
        "--target-lag", type=int, help="max_lag for --suggest (default: scheme.max_lag)"
    )
    parser.add_argument(
        "--max-drop",
        type=float,
        default=0.05,
        help="--suggest rules out splits dropping more (default 0.05)",
    )
    parser.add_argument("--validate", metavar="RUN_DIR", help="predict vs measure a run")
    parser.add_argument("--plot", metavar="PNG", help="write the figure here")
    parser.add_argument("--json", metavar="FILE", help="write the results here as JSON")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="settings overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_sim_config(args.config, args.overrides)
        if args.validate:
            return _validate(args, config)
        if args.suggest:
            return _suggest(args, config)
        return _compare(args, config)
    except (ValueError, FileNotFoundError, SimulationStalled) as error:
        print(f"simulate_run.py: error: {error}", file=sys.stderr)
        return BAD_INPUT


def _compare(args: argparse.Namespace, config: SimConfig) -> int:
    if args.nodes:
        results = sweep(config, args.nodes, args.rollout_fraction)
    else:
        results = [simulate(config, make(config.scheme)) for make in SCHEMES.values()]
    print(format_table(results))
    if args.plot:
        print(f"plot: {plot_sweep(results, args.plot)}")
    _write_json(args.json, [r.to_dict() for r in results])
    return 0


def _suggest(args: argparse.Namespace, config: SimConfig) -> int:
    target = config.scheme.max_lag if args.target_lag is None else args.target_lag
    found = []
    for total in args.nodes or [config.cluster.rollout_nodes + config.cluster.learner_nodes]:
        suggestion = suggest(config, total, target, max_drop_share=args.max_drop)
        print(format_table(suggestion.results))
        for rollout, why in suggestion.skipped.items():
            print(f"  {rollout} rollout node(s) skipped: {why}")
        print(f"suggested for {total} nodes: {suggestion.reason}\n")
        if args.plot:
            out = Path(args.plot)
            if len(args.nodes or []) > 1:
                out = out.with_name(f"{out.stem}_{total}{out.suffix}")
            print(f"plot: {plot_suggestion(suggestion, out)}")
        found.append(
            {
                "total_nodes": total,
                "chosen": suggestion.chosen.to_dict(),
                "reason": suggestion.reason,
                "results": [r.to_dict() for r in suggestion.results],
            }
        )
    _write_json(args.json, found)
    return 0


def _validate(args: argparse.Namespace, config: SimConfig) -> int:
    validation = validate_run(args.validate, config)
    print(format_validation(validation))
    _write_json(
        args.json,
        {
            "figures": {k: v for k, v in asdict(validation.figures).items() if k != "scheme"},
            "predicted": validation.predicted.to_dict(),
            "scale": validation.scale,
            "identifiable": validation.identifiable,
        },
    )
    return 0


def _write_json(path: str | None, data: object) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
        print(f"json: {path}")
