"""The `megatron-fr` command: one subcommand per job.

megatron-fr train RECIPE --run-dir DIR [key=value ...]   train (resumes an existing run)
megatron-fr check RECIPE [key=value ...]     validate a recipe without GPUs; start nothing
megatron-fr rehearse RECIPE [...]            a learner step's memory at real shapes, no GPU
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
import importlib
import os
import sys

from megatron_fr.utils.arguments import parse_with_trailing_overrides

# name, module with add_arguments (or "module:the function that adds them"), function, help
SUBCOMMANDS = (
    ("train", "megatron_fr.orchestrator.train_cli", "main",
     "train from a recipe (starts the learner ranks, engines and rollouts)"),
    ("check", "megatron_fr.orchestrator.train_cli:add_check_arguments", "main",
     "validate a recipe, its model, data and layout without GPUs (train --check)"),
    ("rehearse", "megatron_fr.orchestrator.train_cli:add_rehearse_arguments", "main",
     "rehearse a learner step's memory at the recipe's real shapes, no GPU (train --rehearse)"),
    ("serve", "megatron_fr.engine.serve_cli", "main",
     "run one inference server in the foreground (SGLang, or the CPU engine)"),
    ("plot", "megatron_fr.analysis.plot", "main",
     "PNG of reward, acceptance, lag and eval accuracy of a run directory"),
    ("lengths", "megatron_fr.analysis.length_report", "main",
     "response lengths generated, dropped as stale and trained: table and PNG"),
    ("convert", "megatron_fr.convert.cli", "run",
     "HF <-> megatron checkpoint conversion and logit verification"),
    ("compare", "megatron_fr.analysis.compare", "run",
     "FlashREINFORCE vs GRPO vs RLOO at equal rollouts, or a max_lag sweep"),
    ("demo", "megatron_fr.demo.cli", "main",
     "the CPU demos: `demo prepare RECIPE` makes a demo recipe's tiny model"),
    ("config", "megatron_fr.config.cli", "main",
     "a recipe's resolved settings with their docs (show), every setting's (reference)"),
)  # fmt: skip

COMPUTES = frozenset({"train", "rehearse", "serve", "demo", "compare", "convert"})
"""Commands whose process, or the processes it starts, compute tensors: they pin the CPU
kernels first (utils/cpu_kernels.py); plot, lengths and config only read files."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command's parser. Only `command`'s module is imported (all of them when None): the
    subcommands' modules pull in torch, matplotlib or megatron, and `megatron-fr --help` or
    `config show` should not wait for what they do not run."""
    parser = argparse.ArgumentParser(prog="megatron-fr", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name, function, help_text in SUBCOMMANDS:
        sub = commands.add_parser(name, help=help_text)
        if command is None or name == command:
            module_name, _, adder = module_name.partition(":")
            module = importlib.import_module(module_name)
            getattr(module, adder or "add_arguments")(sub)
            sub.set_defaults(run=getattr(module, function))
    return parser


def chosen_command(argv: list[str]) -> str:
    """The subcommand `argv` names: its first item that is not an option ("" for none, which
    leaves the choice, or the error, to argparse)."""
    return next((item for item in argv if not item.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # train's dotted overrides may follow --run-dir (utils/arguments.py)
    args = parse_with_trailing_overrides(build_parser(chosen_command(argv)), argv)
    if args.command in COMPUTES:
        from megatron_fr.utils.cpu_kernels import pin_cpu_kernels

        pin_cpu_kernels()  # before any tensor maths, here and in the processes it starts
    if args.command == "train" and args.run_dir is not None and not args.check:
        from megatron_fr.utils.quiet import quiet_known_messages

        quiet_known_messages(args.run_dir)  # before megatron's imports say what they lack
    if runs_megatron(args):
        from megatron_fr.parallel.cpu_shims import install_cpu_shims

        install_cpu_shims()
    return args.run(args)


def runs_megatron(args: argparse.Namespace) -> bool:
    """Whether this process runs megatron: a learner rank of `train` started as `train` by
    torchrun (the project's launchers start orchestrator/rank_main.py, which installs them
    itself; the command started by hand only checks the recipe and re-executes itself under
    torchrun), a rehearsal of one (`rehearse`, `train --rehearse`) and checkpoint
    conversion. Those install the CPU shims megatron needs without CUDA first (a no-op with
    CUDA), here at the program's entry point."""
    if args.command == "rehearse":
        return True
    if args.command == "train":
        return args.rehearse or ("WORLD_SIZE" in os.environ and not args.check)
    return args.command == "convert"


if __name__ == "__main__":
    sys.exit(main())
