"""Cost of the FlashREINFORCE loss path relative to a plain vocab-parallel cross-entropy.

On the same vocab-parallel logits, in one run on TP ranks (gloo on CPU):
  baseline  megatron.core.tensor_parallel.vocab_parallel_cross_entropy, forward + backward
  ours      flash_reinforce_parallel_loss (vocab-parallel log-probs + gate + sample-mean loss)
Reports the median time ratio over the repeats and each arm's peak resident memory above
what was resident before it started (logits included), in units of the local logits size.
Peak memory is read from the kernel's high-water mark (VmHWM), reset before each arm.

    .venv/bin/python tools/bench_loss.py                    # B=32 T=1024 V=32768 TP=2
    .venv/bin/python tools/bench_loss.py --batch 4 --seq 256 --repeats 2   # a quick look
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch


def _resident_peak_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _resident_bytes() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def _reset_resident_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _measure(step, base: torch.Tensor, group) -> tuple[float, int, torch.Tensor]:
    """Run one arm on a fresh copy of the logits: (seconds, peak extra bytes, log-probs)."""
    import torch.distributed as dist

    logits = base.clone().requires_grad_(True)
    dist.barrier(group)
    _reset_resident_peak()
    before = _resident_bytes()
    start = time.perf_counter()
    log_probs = step(logits)
    seconds = time.perf_counter() - start
    extra = _resident_peak_bytes() - before
    del logits
    return seconds, extra, log_probs


def bench_rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_fr.config import FlashReinforceConfig, ParallelConfig
    from megatron_fr.parallel import state
    from megatron_fr.parallel.loss import GlobalBatch, LossBatch, flash_reinforce_parallel_loss

    state.initialize(ParallelConfig(tensor=world_size), seed=None)
    group = ps.get_tensor_model_parallel_group()
    gen = torch.Generator().manual_seed(1000 + rank)
    shape = (args.batch, args.seq)
    base = torch.randn(*shape, args.vocab // world_size, generator=gen)
    targets = torch.randint(0, args.vocab, shape, generator=torch.Generator().manual_seed(7))
    mask = torch.ones(shape, dtype=torch.bool)
    mask[:, : args.seq // 4] = False  # a prompt
    segment_ids = torch.arange(args.batch)[:, None].expand(shape).contiguous()
    batch_kwargs = dict(target_ids=targets, action_mask=mask, segment_ids=segment_ids)
    batch_kwargs["positions"] = torch.arange(args.seq).expand(shape).contiguous()
    global_batch = GlobalBatch(advantages=torch.randn(args.batch))
    config = FlashReinforceConfig(delta=args.delta)
    behavior = {}

    def baseline(logits: torch.Tensor) -> torch.Tensor:
        # megatron computes in place in its input; the clone made for it is consumed.
        nll = vocab_parallel_cross_entropy(logits, targets, tp_group=group)
        (nll * mask).sum().div(args.batch).backward()
        return -nll.detach()

    def ours(logits: torch.Tensor) -> torch.Tensor:
        loss_batch = LossBatch(behavior_log_probs=behavior["mu"], **batch_kwargs)
        loss, metrics = flash_reinforce_parallel_loss(
            logits, loss_batch, global_batch, config, tp_group=group
        )
        loss.backward()
        return metrics["log_probs"]

    rows = []
    for repeat in range(args.repeats):
        base_s, base_extra, reference = _measure(baseline, base, group)
        # Behaviour log-probs a little off the current policy, so the gate has work to do.
        behavior["mu"] = (reference - 0.01 * torch.rand(shape, generator=gen)).clamp_max(0)
        ours_s, ours_extra, log_probs = _measure(ours, base, group)
        max_diff = (log_probs - reference)[mask].abs().max().item()
        rows.append(
            dict(
                repeat=repeat,
                baseline_s=base_s,
                ours_s=ours_s,
                max_diff=max_diff,
                baseline_extra=base_extra,
                ours_extra=ours_extra,
            )
        )
    return dict(rows=rows, logits_bytes=base.numel() * base.element_size())


def summarize(per_rank: list[dict]) -> dict:
    logits_bytes = per_rank[0]["logits_bytes"]
    rows = [row for result in per_rank for row in result["rows"]]
    # The slowest rank decides a step: take the max over ranks, then the median over repeats.
    repeats = sorted({row["repeat"] for row in rows})

    def slowest(key: str) -> list[float]:
        return [max(r[key] for r in rows if r["repeat"] == rep) for rep in repeats]

    baseline_s, ours_s = slowest("baseline_s"), slowest("ours_s")
    return dict(
        time_ratio=statistics.median(o / b for o, b in zip(ours_s, baseline_s, strict=True)),
        baseline_s_median=statistics.median(baseline_s),
        ours_s_median=statistics.median(ours_s),
        baseline_extra_logits=max(r["baseline_extra"] for r in rows) / logits_bytes,
        ours_extra_logits=max(r["ours_extra"] for r in rows) / logits_bytes,
        logits_gib_per_rank=logits_bytes / 2**30,
        max_abs_log_prob_diff_vs_megatron=max(r["max_diff"] for r in rows),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="trajectories B")
    parser.add_argument("--seq", type=int, default=1024, help="tokens per trajectory T")
    parser.add_argument("--vocab", type=int, default=32768, help="full vocabulary V")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per arm")
    parser.add_argument("--delta", type=float, default=3e-3, help="trust-region delta")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args(argv)
    if args.vocab % args.tp:
        parser.error(f"--vocab {args.vocab} is not divisible by --tp {args.tp}")
    return args


def main(argv: list[str] | None = None) -> int:
    from megatron_fr.parallel.spawn import run_on_ranks

    args = parse_args(argv)
    per_rank = run_on_ranks(bench_rank, args.tp, args, timeout_s=3600)
    summary = summarize(per_rank)
    print(f"B={args.batch} T={args.seq} V={args.vocab} TP={args.tp} repeats={args.repeats}")
    for key, value in summary.items():
        print(f"  {key:36s} {value:.4g}")
    if args.json:
        args.json.write_text(
            json.dumps(dict(args=vars(args) | {"json": str(args.json)}, summary=summary), indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
