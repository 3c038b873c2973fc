#!/usr/bin/env python
"""Padding of one learner step on a long-tailed batch: one trajectory per row vs packed rows.

Trajectory lengths are drawn lognormal (agent episodes: most short, a few near the context
limit), then laid out by the learner's own rule (megatron_fr/learner/micro_batches.py,
plan_micro_batches) for both modes; the padding fraction is the share of the step's token
slots, over all DP ranks, that hold no trajectory token (the learner's `padding_fraction`).

    python tools/bench_packing.py                       # 128 trajectories, DP 8, budget 20480
    python tools/bench_packing.py --cp 2 --tp 2 --sequence-parallel --json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from megatron_fr.learner.micro_batches import MicroBatchPlan, plan_micro_batches


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trajectories", type=int, default=128, help="batch size B")
    parser.add_argument("--median", type=float, default=4096, help="median length (tokens)")
    parser.add_argument("--sigma", type=float, default=0.8, help="lognormal sigma of lengths")
    parser.add_argument("--max-length", type=int, default=18432, help="context limit (tokens)")
    parser.add_argument("--min-length", type=int, default=256)
    parser.add_argument(
        "--budget",
        type=int,
        default=20480,
        help="micro-batch tokens (LearnerConfig.micro_batch_tokens)",
    )
    parser.add_argument("--dp", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--sequence-parallel", action="store_true", help="TP splits sequences")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def lognormal_lengths(args: argparse.Namespace) -> list[int]:
    generator = torch.Generator().manual_seed(args.seed)
    draws = torch.randn(args.trajectories, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(args.median) + args.sigma * draws)
    return lengths.clamp(args.min_length, args.max_length).round().long().tolist()


def describe(plan: MicroBatchPlan) -> dict[str, float]:
    slots = len(plan.assignment) * plan.count * plan.rows * plan.width
    return {
        "micro_batches_per_rank": plan.count,
        "rows": plan.rows,
        "width": plan.width,
        "token_slots": slots,
        "model_tokens": plan.model_tokens,
        "padding_fraction": round(plan.padding_fraction, 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lengths = lognormal_lengths(args)
    layout = dict(
        dp_size=args.dp,
        micro_batch_tokens=args.budget,
        cp_size=args.cp,
        sequence_parallel_size=args.tp if args.sequence_parallel else 1,
    )
    result = {
        "lengths": {
            "min": min(lengths),
            "median": sorted(lengths)[len(lengths) // 2],
            "max": max(lengths),
            "mean": round(sum(lengths) / len(lengths), 1),
        },
        "padded": describe(plan_micro_batches(lengths, pack=False, **layout)),
        "packed": describe(plan_micro_batches(lengths, pack=True, **layout)),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{args.trajectories} trajectories, lengths {result['lengths']}, DP {args.dp}, "
        f"CP {args.cp}, budget {args.budget}"
    )
    print(f"{'layout':8} {'micro/rank':>10} {'rows x width':>13} {'slots':>10} {'padding':>8}")
    for name in ("padded", "packed"):
        r = result[name]
        shape = f"{r['rows']} x {r['width']}"
        print(
            f"{name:8} {r['micro_batches_per_rank']:>10} {shape:>13} {r['token_slots']:>10} "
            f"{r['padding_fraction']:>8.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
