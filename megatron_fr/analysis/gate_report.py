"""Which trajectories the trust-region gate held out, by the sign of their advantage.

    python tools/gate_by_advantage.py RUN_DIR [RUN_DIR ...] [--delta D] [--from-step S]

Reads each run's batches.jsonl (every trained trajectory's advantage, gate KL D_i and
admission). A gate that admitted mostly failures (A < 0) would push the policy away from
its own samples with little pull towards successes; a gate that admits few trajectories
of either sign leaves each step resting on a handful of trajectories. This report tells the
two apart. With --delta, admission is recomputed as D_i <= delta: what that gate would have
done, e.g. on a run trained without a gate (delta = inf), whose D_i are still recorded.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from megatron_fr.analysis.run_files import BATCHES_FILE, read_run_log


@dataclass(frozen=True)
class GateBySign:
    steps: int
    positive: tuple[int, int]  # (admitted, trajectories) with advantage > 0
    negative: tuple[int, int]  # (admitted, trajectories) with advantage < 0
    admitted_per_step: float  # mean number of admitted trajectories per step
    admitted_advantage: float  # mean over steps of (sum of admitted advantages) / B

    @staticmethod
    def rate(pair: tuple[int, int]) -> float:
        admitted, total = pair
        return admitted / total if total else math.nan


def gate_by_advantage_sign(
    batches: list[dict], delta: float | None = None, from_step: int = 1
) -> GateBySign:
    """Counts over the batches with step >= from_step (one record per step, batches.jsonl)."""
    chosen = [b for b in batches if b["step"] >= from_step]
    if not chosen:
        raise ValueError(f"no batch at step >= {from_step}")
    positive, negative = [0, 0], [0, 0]
    admitted_counts, admitted_sums = [], []
    for record in chosen:
        if "admitted" not in record or "sequence_kl" not in record:
            raise ValueError(
                f"step {record['step']}: batches.jsonl has no gate fields "
                "(the run predates their logging)"
            )
        admitted = (
            record["admitted"] if delta is None else [kl <= delta for kl in record["sequence_kl"]]
        )
        advantages = record["advantages"]
        for advantage, kept in zip(advantages, admitted, strict=True):
            side = positive if advantage > 0 else negative if advantage < 0 else None
            if side is not None:
                side[0] += kept
                side[1] += 1
        admitted_counts.append(sum(admitted))
        kept_sum = sum(a for a, kept in zip(advantages, admitted, strict=True) if kept)
        admitted_sums.append(kept_sum / len(advantages))
    return GateBySign(
        steps=len(chosen),
        positive=(positive[0], positive[1]),
        negative=(negative[0], negative[1]),
        admitted_per_step=sum(admitted_counts) / len(chosen),
        admitted_advantage=sum(admitted_sums) / len(chosen),
    )


def table(rows: list[tuple[str, GateBySign]]) -> str:
    lines = [
        "| run | steps | acceptance, A > 0 | acceptance, A < 0 | admitted per step "
        "| sum of admitted A / B |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r.steps} | {r.rate(r.positive):.3f} ({r.positive[0]}/{r.positive[1]}) "
            f"| {r.rate(r.negative):.3f} ({r.negative[0]}/{r.negative[1]}) "
            f"| {r.admitted_per_step:.1f} | {r.admitted_advantage:+.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (with batches.jsonl)")
    parser.add_argument(
        "--delta",
        type=float,
        default=None,
        help="recompute admission as D_i <= delta (default: the run's own decisions)",
    )
    parser.add_argument("--from-step", type=int, default=1, help="first step counted (default 1)")
    args = parser.parse_args(argv)
    try:
        rows = [
            (
                str(d),
                gate_by_advantage_sign(read_run_log(d, BATCHES_FILE), args.delta, args.from_step),
            )
            for d in args.run_dirs
        ]
    except (OSError, ValueError) as error:
        print(f"gate_by_advantage: {error}")
        return 2
    print(table(rows))
    return 0
