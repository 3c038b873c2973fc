"""`megatron-fr demo prepare RECIPE [key=value ...] [demo.key=value ...]`: make the tiny model a
CPU demo recipe trains, in the recipe's model.hf_dir (reused when already made with the same
settings). Overrides starting with `demo.` set DemoModelConfig (demo/config.py), e.g.
`demo.warm_start.steps=40`; the others are the recipe's own, as for `megatron-fr train`.

    megatron-fr demo prepare examples/cpu_demo.yaml
    megatron-fr train examples/cpu_demo.yaml --run-dir runs/cpu_demo
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser(
        "prepare", help="make a demo recipe's model (model.hf_dir)", description=__doc__
    )
    prepare.add_argument("recipe", help="a CPU demo recipe, e.g. examples/cpu_demo.yaml")
    prepare.add_argument("overrides", nargs="*", help="dotted.key=value; demo.key=value")


def main(args: argparse.Namespace) -> int:
    from megatron_fr.config.run import apply_overrides, load_run_config
    from megatron_fr.demo.config import DEFAULTS, DemoModelConfig
    from megatron_fr.demo.prepare import prepare_model

    demo_overrides = [o.removeprefix("demo.") for o in args.overrides if o.startswith("demo.")]
    recipe_overrides = [o for o in args.overrides if not o.startswith("demo.")]
    try:
        config = load_run_config(args.recipe, recipe_overrides)
        defaults = DEFAULTS.get(config.task.name, DemoModelConfig())
        demo = DemoModelConfig.model_validate(
            apply_overrides(defaults.model_dump(mode="json"), demo_overrides)
        )
        report = prepare_model(config, demo)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"megatron-fr demo prepare: error: {error}", file=sys.stderr)
        return 2
    print(report, flush=True)
    print(f"next: megatron-fr train {args.recipe} --run-dir RUN_DIR{_overrides(recipe_overrides)}")
    return 0


def _overrides(overrides: list[str]) -> str:
    """The recipe overrides `train` needs too (the model's directory among them), quoted."""
    import shlex

    return "".join(f" {shlex.quote(item)}" for item in overrides)
