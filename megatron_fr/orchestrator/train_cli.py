"""`megatron-fr train RECIPE --run-dir DIR [dotted.key=value ...]` (also `python -m megatron_fr`).

Started by hand, the command checks the recipe once and re-executes itself as torchrun with
`learner_ranks` processes of orchestrator/rank_main.py, the learner ranks' own entry point
(same PID, so stopping it stops the run; the Slurm job starts the same module under torchrun
on each learner node); launcher variables set by hand are refused (orchestrator/preflight.py).
The same command resumes a run that was stopped. `megatron-fr check` and `megatron-fr
rehearse` are `train --check` and `train --rehearse` as commands of their own.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_fr.config.run import RunConfig


CHECK_HELP = (
    "validate the recipe, model, data, chat template, lengths and layout without GPUs, print "
    "a summary; start nothing"
)
EPILOG = (
    "The settings a recipe resolves to, with their defaults and docs: `megatron-fr config "
    "show RECIPE [KEY] [key=value ...]`; every setting: `megatron-fr config reference`."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`megatron-fr train`: a run, or (aliases) `--check` and `--rehearse`."""
    parser.epilog = EPILOG
    _add_recipe(parser)
    parser.add_argument(
        "--run-dir", type=Path, help="outputs; resumed if present (required unless --check)"
    )
    parser.add_argument("--check", action="store_true", help=f"{CHECK_HELP} (`megatron-fr check`)")
    _add_layout_flags(parser)
    from megatron_fr.launch import rehearse_cli

    rehearse_cli.add_arguments(parser)
    _add_overrides(parser)


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """`megatron-fr check RECIPE`: what `train --check` does."""
    parser.description = CHECK_HELP
    parser.epilog = EPILOG
    _add_recipe(parser)
    _add_layout_flags(parser)
    _add_overrides(parser)
    parser.set_defaults(check=True, rehearse=False, run_dir=None)


def add_rehearse_arguments(parser: argparse.ArgumentParser) -> None:
    """`megatron-fr rehearse RECIPE`: what `train --rehearse` does."""
    from megatron_fr.launch import rehearse_cli

    parser.description = rehearse_cli.REHEARSE_HELP
    _add_recipe(parser)
    _add_layout_flags(parser)
    rehearse_cli.add_rehearsal_flags(parser)
    _add_overrides(parser)
    parser.set_defaults(check=False, rehearse=True, run_dir=None)


def _add_recipe(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file (YAML), e.g. examples/cpu_demo.yaml")


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", help="dotted.key=value (value read as YAML)")


def _add_layout_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-size",
        type=int,
        default=0,
        help="check, rehearse: learner ranks of the layout (default: the recipe's "
        "cluster.learner_nodes x learner_ranks)",
    )
    parser.add_argument(
        "--gpu-mem-gb",
        type=float,
        default=None,
        help="check, rehearse: judge the per-GPU memory against this size",
    )


def main(args: argparse.Namespace) -> int:
    """`train` (and `check`, `rehearse`: the same namespace with their flag set). Started by
    hand it checks the recipe and re-executes itself under torchrun; started by torchrun (a
    rank, through orchestrator/rank_main.py) it is one rank."""
    from megatron_fr.config.run import load_run_config
    from megatron_fr.orchestrator import preflight
    from megatron_fr.orchestrator.check import check_recipe
    from megatron_fr.orchestrator.workload import resolve_task

    command = getattr(args, "command", "train")  # as typed: train (its aliases too), check
    try:
        launched = preflight.launch_environment()  # (rank, world) under torchrun
        _check_arguments(args)
        config = resolve_task(load_run_config(args.recipe, args.overrides))
        world = args.world_size or (launched[1] if launched else config.learner_world)
        if args.rehearse:
            from megatron_fr.launch import rehearse_cli

            return rehearse_cli.run(config, world, args)
        if args.check:
            print(check_recipe(config, world, args.gpu_mem_gb))
            print("recipe OK (nothing was started)")
            return 0
        if args.run_dir is None:
            raise ValueError("--run-dir is required (or --check)")
        if launched is None and config.cluster.learner_nodes > 1:
            raise ValueError(
                f"the recipe is laid out for cluster.learner_nodes {config.cluster.learner_nodes}"
                f" (x learner_ranks {config.learner_ranks}); started by hand, train runs one "
                "node: submit it with slurm/launch.sh, or run torchrun on each node"
            )
        preflight.check_run_dir(args.run_dir)
        check_before_start(config, world, render=launched is None)
        if launched is None:
            preflight.check_resume(args.run_dir, world)
            preflight.check_engines(config)
    except (ValueError, OSError) as error:
        print(f"megatron-fr {command}: error: {error}", file=sys.stderr)
        return 2
    if launched is None:
        _exec_torchrun(config.learner_ranks, args)
    return run_rank(config, args.run_dir)


def check_before_start(config: RunConfig, world: int, render: bool) -> None:
    """What is checked before a run starts anything: the recipe (rendered prompts too where
    `render`: the parent does it once, the ranks repeat only what is quick) and the engines'
    environment when the run starts them. ValueError naming the first problem."""
    from megatron_fr.engine.launcher import check_engine_machine
    from megatron_fr.orchestrator.check import check_recipe

    check_recipe(config, world, gpu_mem_gb=None, render=render)
    if config.rollout.engine.started:
        remedy = "set rollout.engine.kind=cpu, or give rollout.engine.urls and count 0"
        engine = config.rollout.engine
        check_engine_machine(engine.kind, "rollout.engine.kind", remedy, engine.python)


def _check_arguments(args: argparse.Namespace) -> None:
    if args.world_size < 0:
        raise ValueError(f"--world-size {args.world_size}: must be at least 1")
    memory = args.gpu_mem_gb
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise ValueError(f"--gpu-mem-gb {memory}: must be a positive number of GiB")
    from megatron_fr.launch.rehearse_args import check_flags

    check_flags(args)  # the world's bound; the rehearsal's flags only with --rehearse


def run_rank(config: RunConfig, run_dir: Path) -> int:
    """This process's learner rank, to the end of the run; a run that fails on its storage
    (disk full, quota) ends with one line naming the file, one that ends well with the first
    rank's summary of its metrics (orchestrator/summary.py)."""
    from megatron_fr.engine.group import match_sglang_nccl_env
    from megatron_fr.orchestrator.preflight import describe_storage_error
    from megatron_fr.utils.parent_watch import exit_when_parent_dies

    # before any NCCL communicator: the ranks make them (the parent that checked the recipe
    # and started torchrun needs no torch), and the engines the first rank starts inherit it
    match_sglang_nccl_env()
    exit_when_parent_dies()  # torchrun runs ranks in sessions of their own
    import torch

    from megatron_fr.orchestrator.controller import RUN_ENDINGS, train
    from megatron_fr.parallel.state import FirstRankFailed

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # ranks and the CPU engine share the cores
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        train(config, run_dir)
    except FirstRankFailed:
        return 1  # the first rank says why, once
    except RUN_ENDINGS as error:
        print(f"megatron-fr train: error: {error}", file=sys.stderr, flush=True)
        return 1
    except Exception as error:
        storage = describe_storage_error(error, run_dir)
        if storage is None:
            raise
        print(f"megatron-fr train: error: {storage}", file=sys.stderr, flush=True)
        return 1
    if os.environ.get("RANK") == "0":  # the first rank says how the run went, once
        from megatron_fr.orchestrator.summary import run_summary

        print(run_summary(run_dir, config.steps, config.report.tensorboard), flush=True)
    return 0


def _exec_torchrun(ranks: int, args: argparse.Namespace) -> None:
    from megatron_fr.utils.net import free_port

    if ranks > 1:
        # torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset, with a banner on
        # every start (torch/distributed/run.py); the value it would set, set here, keeps the
        # ranks' threads as they were, and the banner off the console
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    command = [
        sys.executable,
        "-m",
        "megatron_fr.orchestrator.torchrun",
        "--nproc-per-node",
        str(ranks),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "megatron_fr.orchestrator.rank_main",
        str(args.recipe),
        "--run-dir",
        str(args.run_dir),
        *args.overrides,
    ]
    os.execv(sys.executable, command)
