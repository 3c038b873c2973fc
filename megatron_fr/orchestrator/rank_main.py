"""One learner rank: what torchrun starts, on one machine (`megatron-fr train` re-executes
itself as torchrun over this module) or on each learner node of a Slurm job (slurm/job.sh).

    python -m megatron_fr.orchestrator.rank_main RECIPE --run-dir DIR [dotted.key=value ...]

It is not a command to type: it refuses to run outside torchrun (RANK, WORLD_SIZE and
TORCHELASTIC_RUN_ID set). Before anything else it pins the CPU kernels, quiets the
dependencies' known start-up messages into the run's log and installs the CPU shims megatron
needs without CUDA (a no-op with CUDA); then it repeats the recipe's quick checks (the parent
did the slow ones once) and runs the training loop to the end (train_cli.run_rank).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_fr.orchestrator.rank_main",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("recipe", help="recipe file (YAML)")
    parser.add_argument("--run-dir", type=Path, required=True, help="the run's directory")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value (value read as YAML)")
    args, extra = parser.parse_known_args(argv)
    unknown = [item for item in extra if "=" not in item or item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]  # overrides may follow --run-dir
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from megatron_fr.orchestrator import preflight

    try:
        launched = preflight.launch_environment()
        if launched is None:
            raise ValueError(
                "this is a learner rank's entry point, started by torchrun: run "
                "`megatron-fr train RECIPE --run-dir DIR` instead"
            )
    except ValueError as error:
        print(f"megatron-fr rank: error: {error}", file=sys.stderr)
        return 2
    from megatron_fr.parallel.cpu_shims import install_cpu_shims
    from megatron_fr.utils.cpu_kernels import pin_cpu_kernels
    from megatron_fr.utils.quiet import quiet_known_messages

    pin_cpu_kernels()
    quiet_known_messages(args.run_dir)  # before megatron's imports say what they lack
    install_cpu_shims()
    from megatron_fr.config.run import load_run_config
    from megatron_fr.orchestrator.train_cli import check_before_start, run_rank
    from megatron_fr.orchestrator.workload import resolve_task

    try:
        preflight.check_run_dir(args.run_dir)
        config = resolve_task(load_run_config(args.recipe, args.overrides))
        check_before_start(config, launched[1], render=False)
    except (ValueError, OSError) as error:
        print(f"megatron-fr train: error: {error}", file=sys.stderr)
        return 2
    return run_rank(config, args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
