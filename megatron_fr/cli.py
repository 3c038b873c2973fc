"""The `megatron-fr` command: one subcommand per job.

megatron-fr train RECIPE --run-dir DIR [key=value ...]   train (resumes an existing run)
megatron-fr serve --engine cpu|sglang --model-path D --port P   one inference server
megatron-fr demo prepare RECIPE [key=value ...]          make a CPU demo recipe's tiny model
megatron-fr plot RUN_DIR [--out FILE]    reward / acceptance / lag / eval accuracy plot
megatron-fr lengths RUN_DIR [...]        response lengths generated / dropped as stale / trained
megatron-fr compare methods|lag RECIPE --out DIR   sample efficiency / lag stability benchmark
megatron-fr convert ACTION ...          HF <-> megatron checkpoints (hf-to-megatron,
                                        megatron-to-hf, verify)
megatron-fr config show RECIPE [KEY]    a recipe's resolved settings, their defaults and docs
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    from megatron_fr.config import cli as config
    from megatron_fr.convert import cli as convert
    from megatron_fr.demo import cli as demo
    from megatron_fr.engine import serve_cli
    from megatron_fr.orchestrator import compare, length_report, plot, train_cli

    parser = argparse.ArgumentParser(prog="megatron-fr", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    subcommands = (  # name, module with add_arguments and the function to run, help
        ("train", train_cli, train_cli.main,
         "train from a recipe (starts the learner ranks, engines and rollouts)"),
        ("serve", serve_cli, serve_cli.main,
         "run one inference server in the foreground (SGLang, or the CPU engine)"),
        ("plot", plot, plot.main,
         "PNG of reward, acceptance, lag and eval accuracy of a run directory"),
        ("lengths", length_report, length_report.main,
         "response lengths generated, dropped as stale and trained: table and PNG"),
        ("convert", convert, convert.run,
         "HF <-> megatron checkpoint conversion and logit verification"),
        ("compare", compare, compare.run,
         "FlashREINFORCE vs GRPO vs RLOO at equal rollouts, or a max_lag sweep"),
        ("demo", demo, demo.main,
         "the CPU demos: `demo prepare RECIPE` makes a demo recipe's tiny model"),
        ("config", config, config.main,
         "a recipe's resolved settings with their docs (show), every setting's (reference)"),
    )  # fmt: skip
    for name, module, run, help_text in subcommands:
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        sub.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # train's dotted overrides may follow --run-dir, which argparse's positional matching
    # does not allow; they come back as unknown arguments and are appended here.
    args, extra = parser.parse_known_args(argv)
    if extra and getattr(args, "overrides", None) is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        unknown = [item for item in extra if "=" not in item or item.startswith("-")]
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.overrides = [*args.overrides, *extra]
    if runs_megatron(args):
        from megatron_fr.parallel.cpu_shims import install_cpu_shims

        install_cpu_shims()
    return args.run(args)


def runs_megatron(args: argparse.Namespace) -> bool:
    """Whether this process runs megatron: a learner rank of `train` (started by torchrun or
    srun; the command started by hand only checks the recipe and re-executes itself under
    torchrun), a rehearsal of one (`train --rehearse`) and checkpoint conversion. Those
    install the CPU shims megatron needs without CUDA first (a no-op with CUDA), here at the
    program's entry point."""
    if args.command == "train":
        return args.rehearse or ("WORLD_SIZE" in os.environ and not args.check)
    return args.command == "convert"


if __name__ == "__main__":
    sys.exit(main())
