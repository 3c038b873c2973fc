"""One learner rank: what torchrun starts, on one machine (`megatron-fr train` re-executes
itself as torchrun over this module) or on each learner node of a Slurm job (slurm/job.sh).

    python -m megatron_fr.orchestrator.rank_main RECIPE --run-dir DIR [dotted.key=value ...]

It is not a command to type: it refuses to run outside torchrun (RANK, WORLD_SIZE and
TORCHELASTIC_RUN_ID set). Before anything else it pins the CPU kernels, quiets the
dependencies' known start-up messages into the run's log and installs the CPU shims megatron
needs without CUDA (a no-op with CUDA); then it is `train` started by torchrun
(train_cli.main): the recipe's quick checks (the parent did the slow ones once), then the
training loop to the end.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_fr.utils.arguments import parse_with_trailing_overrides


def parse(argv: list[str]) -> argparse.Namespace:
    """The rank's arguments, as train's namespace for its run (train_cli.main)."""
    parser = argparse.ArgumentParser(
        prog="python -m megatron_fr.orchestrator.rank_main",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("recipe", help="recipe file (YAML)")
    parser.add_argument("--run-dir", type=Path, required=True, help="the run's directory")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value (value read as YAML)")
    parser.set_defaults(command="train", check=False, rehearse=False, world_size=0)
    parser.set_defaults(gpu_mem_gb=None)
    return parse_with_trailing_overrides(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from megatron_fr.orchestrator import preflight

    try:
        if preflight.launch_environment() is None:
            raise ValueError(
                "this is a learner rank's entry point, started by torchrun: run "
                "`megatron-fr train RECIPE --run-dir DIR` instead"
            )
    except ValueError as error:
        print(f"megatron-fr rank: error: {error}", file=sys.stderr)
        return 2
    from megatron_fr.orchestrator.train_cli import main as train
    from megatron_fr.parallel.cpu_shims import install_cpu_shims
    from megatron_fr.utils.cpu_kernels import pin_cpu_kernels
    from megatron_fr.utils.quiet import quiet_known_messages

    pin_cpu_kernels()
    quiet_known_messages(args.run_dir)  # before megatron's imports say what they lack
    install_cpu_shims()
    return train(args)  # started by torchrun: the rank's checks, then its run


if __name__ == "__main__":
    sys.exit(main())
