"""`megatron-fr prepare RECIPE --run-dir DIR [dotted.key=value ...]`: the model a run starts from.

One process, no torchrun: a launcher runs it before starting the inference servers, which need
the model directory before the learner ranks exist. With model.hf_dir in the recipe it checks
that directory; otherwise it warm-starts the task's tiny model into DIR/warm_start (reused on a
second call). The last line printed is the HF directory.
"""

from __future__ import annotations

import argparse
import sys

from megatron_fr.orchestrator.train_cli import add_arguments


def main(args: argparse.Namespace) -> int:
    from megatron_fr.config.run import load_run_config
    from megatron_fr.orchestrator.workload import prepare_hf_model

    try:
        config = load_run_config(args.recipe, args.overrides)
        args.run_dir.mkdir(parents=True, exist_ok=True)
        hf_dir = prepare_hf_model(config, args.run_dir)
    except (ValueError, FileNotFoundError) as error:
        print(f"megatron-fr prepare: error: {error}", file=sys.stderr)
        return 2
    print(hf_dir.resolve(), flush=True)
    return 0


__all__ = ["add_arguments", "main"]
