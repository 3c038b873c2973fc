"""The `megatron-fr` command: one subcommand per job.

megatron-fr smoke [--tp 2 --steps 8]    CPU smoke run of the learner and the loss
megatron-fr plot RUN_DIR [--out FILE]    reward / acceptance / lag / eval accuracy plot
megatron-fr convert ACTION ...          HF <-> megatron checkpoints (hf-to-megatron,
                                        megatron-to-hf, verify)
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from megatron_fr.convert import cli as convert
    from megatron_fr.learner import smoke
    from megatron_fr.orchestrator import plot

    parser = argparse.ArgumentParser(prog="megatron-fr", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    smoke_parser = commands.add_parser(
        "smoke", help="CPU smoke run: a tiny megatron GPT learns a toy reward (gloo ranks)"
    )
    smoke.add_arguments(smoke_parser)
    smoke_parser.set_defaults(run=smoke.main)
    convert_parser = commands.add_parser(
        "convert", help="HF <-> megatron checkpoint conversion and logit verification"
    )
    convert.add_arguments(convert_parser)
    convert_parser.set_defaults(run=convert.run)
    plot_parser = commands.add_parser(
        "plot", help="PNG of reward, acceptance, lag and eval accuracy of a run directory"
    )
    plot.add_arguments(plot_parser)
    plot_parser.set_defaults(run=plot.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
