#!/usr/bin/env python
"""Check or enumerate learner layouts for a model on N nodes x G GPUs (megatron_fr/launch/plan.py
has the formulas and their sources).

    python tools/plan_layout.py --model qwen3-30b-a3b --nodes 1 --gpus-per-node 8 \
        --gpu-mem-gb 80 --tp 4 --ep 8 --etp 1            # check one layout
    python tools/plan_layout.py --model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 \
        --gpu-mem-gb 80 --json                           # every layout that fits, best first
    python tools/plan_layout.py --recipe examples/qwen3_30b_a3b_lag8.yaml --gpu-mem-gb 80

--recipe reads the model (model.hf_dir's config.json, else the preset of its name), the
learner nodes and ranks per node (cluster.learner_nodes, learner_ranks), the layout
(parallel.*), learner.micro_batch_tokens, recompute and params_dtype, the entropies, the
longest row and the weight sync's buckets from the recipe (check mode); any flag given
overrides the recipe's value.

Any of --tp/--pp/--cp/--ep/--etp selects check mode (the others default to 1, ETP to TP as in
megatron). Exit status: 0 valid (and fits with --recompute when --gpu-mem-gb is given; when
enumerating, some layout fits with some recompute setting), 2 invalid layout (the reason is
printed; --row-tokens: its micro-batches cannot hold the rows), 3 valid but too big /
nothing fits.
"""

from __future__ import annotations

import argparse
import json
import sys

from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.launch.plan import (
    DEFAULT_RESERVE_GIB,
    RECOMPUTE,
    LayoutError,
    describe,
    enumerate_layouts,
    plan_layout,
)
from megatron_fr.models.hf_config import load_hf_config, preset_names

INVALID, TOO_BIG = 2, 3
LAYOUT_FLAGS = ("tp", "pp", "cp", "ep", "etp")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--recipe", help="a recipe (YAML): its model, world, layout and learner settings"
    )
    parser.add_argument(
        "--model",
        help=f"preset ({', '.join(preset_names())}), HF checkpoint dir, or config.json "
        "(required without --recipe)",
    )
    parser.add_argument("--nodes", type=int, help="learner nodes (required without --recipe)")
    parser.add_argument(
        "--gpus-per-node", type=int, help="learner ranks per node (required without --recipe)"
    )
    parser.add_argument("--gpu-mem-gb", type=float, help="GPU memory in GiB (H100: 80)")
    parser.add_argument(
        "--reserve-gb",
        type=float,
        default=DEFAULT_RESERVE_GIB,
        help="GiB kept free for the CUDA context, NCCL and fragmentation (a rule of thumb)",
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        help="tokens of a micro-batch per GPU (LearnerConfig.micro_batch_tokens; default: the "
        "recipe's, or LearnerConfig's)",
    )
    parser.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        help="activation recompute the learner runs with (LearnerConfig.recompute): check mode "
        "judges the fit with it",
    )
    parser.add_argument(
        "--row-tokens",
        type=int,
        help="the recipe's longest row: layouts whose micro-batches cannot hold it are refused",
    )
    parser.add_argument("--params-dtype", choices=("bfloat16", "float32"))
    parser.add_argument(
        "--entropies",
        action="store_true",
        help="the loss computes token entropies (negative_token_fraction < 1): one more "
        "fp32 buffer of a loss chunk's logits on the last stage",
    )
    for flag in LAYOUT_FLAGS:
        parser.add_argument(f"--{flag}", type=int, help=f"{flag.upper()} size (check mode)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sync = _from_recipe(args) if args.recipe else {}
        for name in ("model", "nodes", "gpus_per_node"):
            if getattr(args, name) is None:
                parser.error(f"--{name.replace('_', '-')} is required without --recipe")
        spec = load_hf_config(args.model)
    except (FileNotFoundError, ValueError) as error:
        print(f"plan_layout: error: {error}", file=sys.stderr)
        return INVALID
    world = args.nodes * args.gpus_per_node
    learner = LearnerConfig.model_fields
    args.recompute = args.recompute or learner["recompute"].default
    options = dict(
        micro_batch_tokens=args.micro_batch_tokens or learner["micro_batch_tokens"].default,
        params_dtype=args.params_dtype or "bfloat16",
        gpu_mem_gib=args.gpu_mem_gb,
        reserve_gib=args.reserve_gb,
        entropies=args.entropies,
        row_tokens=args.row_tokens,
        **sync,
    )
    if args.recipe or any(getattr(args, flag) is not None for flag in LAYOUT_FLAGS):
        return _check(spec, world, args, options)
    plans = enumerate_layouts(spec, world, args.gpus_per_node, **options)
    if args.json:
        print(json.dumps([plan.to_dict() for plan in plans], indent=2))
    else:
        print("\n".join(describe(plan) for plan in plans) or "no valid layout fits")
    return 0 if plans else TOO_BIG


def _from_recipe(args: argparse.Namespace) -> dict:
    """Fill every flag not given from the recipe; the weight sync's options for plan_layout."""
    from megatron_fr.config.run import load_run_config
    from megatron_fr.launch.rehearse_cli import model_spec
    from megatron_fr.orchestrator.check import _row_tokens

    config = load_run_config(args.recipe)
    learner, p = config.learner, config.parallel
    if args.model is None:
        _, source = model_spec(config)
        args.model = source.removesuffix(" (preset)")
    defaults = dict(
        nodes=config.cluster.learner_nodes,
        gpus_per_node=config.learner_ranks,
        micro_batch_tokens=learner.micro_batch_tokens,
        recompute=learner.recompute,
        params_dtype=learner.params_dtype,
        row_tokens=_row_tokens(config.task)[0],
        tp=p.tensor,
        pp=p.pipeline,
        cp=p.context,
        ep=p.expert,
        etp=p.effective_expert_tensor,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.entropies = args.entropies or learner.flash_reinforce.negative_token_fraction < 1
    return dict(
        sync_bucket_bytes=config.weights.bucket_mib * 2**20, sync_overlap=config.weights.overlap
    )


def _check(spec, world: int, args: argparse.Namespace, options: dict) -> int:
    tp = args.tp or 1
    try:
        parallel = ParallelConfig(
            tensor=tp,
            pipeline=args.pp or 1,
            context=args.cp or 1,
            expert=args.ep or 1,
            expert_tensor=args.etp,
            sequence_parallel=tp > 1,
        )
        plan = plan_layout(spec, parallel, world, **options)
    except (LayoutError, ValueError) as error:
        hint = ""
        if args.etp is None and args.ep and tp > 1:
            hint = " (ETP defaults to TP, as in megatron; pass --etp 1 for TP-only attention)"
        if args.json:
            print(json.dumps({"valid": False, "reason": f"{error}{hint}"}))
        print(f"plan_layout: invalid layout: {error}{hint}", file=sys.stderr)
        return INVALID
    print(json.dumps(plan.to_dict() | {"valid": True}, indent=2) if args.json else describe(plan))
    return TOO_BIG if plan.fits(args.recompute) is False else 0


if __name__ == "__main__":
    sys.exit(main())
