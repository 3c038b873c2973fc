"""The flagship's weight-sync time, projected from the CPU benchmark's per-bucket figures.

    .venv/bin/python tools/bench_weight_sync.py             # measures; bench_out/*.json
    .venv/bin/python tools/bench_weight_sync.py --project   # this projection
    .venv/bin/python tools/bench_weight_sync.py --project --gather-gbps 1600 --bucket-overhead-ms 20
    .venv/bin/python tools/bench_weight_sync.py --project --engines-per-group   # k = 1, 2, all

The recipe (examples/qwen3_30b_a3b_lag8.yaml: learner TP4 + SP, EP8, ETP1, PP1 on 16 ranks,
four SGLang TP4 servers) has one pipeline stage, so ONE sending rank sends every byte:

    S  = the model's HF bytes (bf16, from the preset's shapes), of which
         D  = dense bytes split over TP (embedding, lm_head, q/k/v, o_proj; the MLP of a dense
              model), E = expert bytes (split over EP x ETP); norms and router are replicated
    G  = bytes the sender receives from its peers while resharding
       = D (1 - 1/TP) + E (1 - 1/(EP x ETP))
    R  = reshard time = G x s, s = seconds per received byte. Measured: the benchmark's walk
         time over the bytes its sender received, so the HF mapping and bucketing are charged
         per received byte too. On the flagship's GPUs the shards come over NVLink, not gloo
         over loopback TCP: --gather-gbps replaces the measured rate by one you assume.
    W  = wire time = S x 8 / bandwidth (the sender's link carries each byte once: NCCL's
         broadcast pipelines the bytes through the engines' ranks)
    n  = ceil(S / bucket) buckets;  r = R / n,  w = W / n + c, where c is a fixed cost per
         bucket (the /update_weights_from_distributed call and the engines' load of the
         bucket; not measured here: --bucket-overhead-ms, 0 unless given)
    one after the other:  T = R + n w
    overlapped (weights.overlap, two buckets in flight):
                          T = r + (n - 1) max(r, w) + w = max(R, n w) + min(r, w)

Topology (--engines-per-group K ...; alone: 1 2 all). The recipe's E engines
(cluster.servers: four SGLang TP4 servers) are split into weight-update groups of k engines
each, g = ceil(E / k) groups; k = all (g = 1) is the one group the sync forms today, k = 1 a
group per engine. The buckets are built once and each is sent to every group, the groups one
after the other from the same sender (concurrent groups would share the sender's one NIC: the
same wire time), and each group's send carries its own per-bucket call:

    R  paid once;  W_g = g x W;  w = W_g / n + g c
    one after the other:  T = R + n w;  overlapped: T = r + (n - 1) max(r, w) + w

An engine that dies mid-broadcast holds the schedulers of the engines in its own group in the
broken collective (SGLang's /init_weights_update_group takes no timeout: torch's default of
30 min), so they miss the regroup bound and leave the pool with it: one death takes out k
engines (all E with one group), printed as "out after one death". The decision and what a
survivor goes through in each topology: docs/weight-sync.md, "One group or a group per engine".

Not modelled: the pause / commit calls and the cache flush (a few HTTP round trips), and the
plan built once per run. Anchors to compare with, as reported by others for Qwen3-30B-A3B:
~7 s with verl's checkpoint engine, 10-16 s with slime's 512 MiB buckets.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "qwen3_30b_a3b_lag8.yaml"
ANCHORS = "verl checkpoint engine ~7 s; slime, 512 MiB buckets: 10-16 s"


@dataclass(frozen=True)
class ModelBytes:
    dense_sharded: int
    replicated: int
    experts: int

    @property
    def total(self) -> int:
        return self.dense_sharded + self.replicated + self.experts


def model_bytes(spec, dtype_bytes: int = 2) -> ModelBytes:
    """The HF bytes of `spec`'s model by how the learner splits them."""
    h, layers = spec.hidden_size, spec.num_layers
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    attention = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if spec.qkv_bias else 0)
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    norms = 2 * h + (2 * spec.head_dim if spec.qk_layernorm else 0)
    if spec.is_moe:
        mlp, router = 0, spec.num_experts * h
        experts = spec.num_experts * 3 * spec.moe_intermediate_size * h
    else:
        mlp, router, experts = 3 * spec.intermediate_size * h, 0, 0
    return ModelBytes(
        dense_sharded=dtype_bytes * (embeddings + layers * (attention + mlp)),
        replicated=dtype_bytes * (h + layers * (norms + router)),
        experts=dtype_bytes * layers * experts,
    )


def received_bytes(sizes: ModelBytes, tp: int, ep: int, etp: int) -> float:
    """G: what the stage's sender receives from its peers."""
    return sizes.dense_sharded * (1 - 1 / tp) + sizes.experts * (1 - 1 / (ep * etp))


def sync_seconds(
    total: int,
    reshard_s: float,
    wire_gbps: float,
    bucket_bytes: int,
    overhead_s: float,
    groups: int = 1,
) -> dict[str, float]:
    """R, W (g x W with `groups` g), and T one after the other and overlapped, by the
    formulas above."""
    n = math.ceil(total / bucket_bytes)
    wire_s = groups * total * 8 / (wire_gbps * 1e9)
    r, w = reshard_s / n, wire_s / n + groups * overhead_s
    return dict(
        buckets=n,
        reshard=reshard_s,
        wire=wire_s,
        in_line=reshard_s + n * w,
        overlapped=r + (n - 1) * max(r, w) + w,
    )


def engines_per_group(text: str) -> int | None:
    """K of --engines-per-group: a positive integer, or None for 'all' (one group)."""
    if text == "all":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1 engine per group")
    return value


TOPOLOGIES: tuple[int | None, ...] = (1, 2, None)
"""--engines-per-group given alone: a group per engine, groups of two, one group (today)."""


def group_count(engines: int, per_group: int | None) -> int:
    """g = ceil(engines / k); one group for k = all (None)."""
    return 1 if per_group is None else math.ceil(engines / per_group)


def seconds_per_received_byte(bench: dict) -> float:
    """s from a benchmark record: its best walk over the bytes its sender received."""
    received = sum(bench["received"])
    if not received:
        raise ValueError("the benchmark's sender received nothing (run it at EP2 or TP2)")
    return bench["reshard_s"] / received


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("bench", type=Path, help="a bench_weight_sync.py record (JSON)")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--model", default="qwen3-30b-a3b", help="preset with the shapes")
    parser.add_argument("--wire-gbps", type=float, nargs="+", default=[100, 200, 400])
    parser.add_argument(
        "--gather-gbps",
        type=float,
        default=None,
        help="an assumed reshard rate (Gb/s received by the sender) instead of the measured one",
    )
    parser.add_argument("--bucket-overhead-ms", type=float, default=0.0)
    parser.add_argument(
        "--engines-per-group",
        nargs="*",
        type=engines_per_group,
        default=None,
        metavar="K",
        help="also the sync time and the engines one death takes out with weight-update groups "
        "of K engines (an integer or 'all'); given alone: 1 2 all",
    )
    args = parser.parse_args(argv)
    if args.engines_per_group == []:
        args.engines_per_group = list(TOPOLOGIES)
    from megatron_fr.config.run import load_run_config
    from megatron_fr.models.hf_config import load_hf_config

    if not args.bench.is_file():
        parser.error(f"{args.bench}: no benchmark record; run tools/bench_weight_sync.py first")
    bench, run = json.loads(args.bench.read_text()), load_run_config(args.recipe)
    if run.parallel.pipeline != 1:
        parser.error(f"{args.recipe}: pipeline {run.parallel.pipeline}; the formula is for 1 stage")
    if args.gather_gbps:
        per_byte, rate = 8 / (args.gather_gbps * 1e9), f"assumed {args.gather_gbps:g} Gb/s"
    else:
        per_byte = seconds_per_received_byte(bench)
        rate = f"measured {1 / per_byte / 1e9:.2f} GB/s ({bench['layout']}, {args.bench.name})"
    report(args, run, load_hf_config(args.model), per_byte, rate)


def report(args: argparse.Namespace, run, spec, per_byte: float, rate: str) -> None:
    layout, sizes = run.parallel, model_bytes(spec)
    received = received_bytes(sizes, layout.tensor, layout.expert, layout.effective_expert_tensor)
    bucket_mib = run.weights.bucket_mib
    print(
        f"{args.model} in {args.recipe.name}: TP{layout.tensor} EP{layout.expert} "
        f"ETP{layout.effective_expert_tensor} PP1, {bucket_mib} MiB buckets"
    )
    gb = {key: f"{value / 1e9:.2f}" for key, value in vars(sizes).items()}
    print(
        f"  S = {sizes.total / 1e9:.1f} GB (split over TP: {gb['dense_sharded']}, "
        f"experts: {gb['experts']}, replicated: {gb['replicated']})"
    )
    print(f"  G = {received / 1e9:.1f} GB received by the sender; reshard rate: {rate}")
    print(f"  fixed cost per bucket c = {args.bucket_overhead_ms:g} ms; anchors: {ANCHORS}")
    print(
        f"{'wire Gb/s':>10} {'buckets':>8} {'R s':>7} {'W s':>7} {'in line s':>10} "
        f"{'overlapped s':>13}"
    )
    for gbps in args.wire_gbps:
        t = sync_seconds(
            sizes.total,
            received * per_byte,
            gbps,
            bucket_mib * 2**20,
            args.bucket_overhead_ms / 1e3,
        )
        print(
            f"{gbps:>10g} {t['buckets']:>8d} {t['reshard']:>7.2f} {t['wire']:>7.2f} "
            f"{t['in_line']:>10.2f} {t['overlapped']:>13.2f}"
        )
    if args.engines_per_group:
        report_topologies(args, run, sizes.total, received * per_byte)


def report_topologies(args: argparse.Namespace, run, total: int, reshard_s: float) -> None:
    """Per k of --engines-per-group and per wire: g, the engines one death takes out, W_g and
    T one after the other and overlapped."""
    engines = run.cluster.servers
    print(
        f"groups of k engines: {engines} engines (cluster.servers), g = ceil({engines} / k) "
        "groups sent one after the other; R once, wire g x W"
    )
    print(
        f"{'k':>4} {'groups':>6} {'out after one death':>20} {'wire Gb/s':>10} {'g x W s':>8} "
        f"{'in line s':>10} {'overlapped s':>13}"
    )
    for per_group in args.engines_per_group:
        groups = group_count(engines, per_group)
        k = "all" if per_group is None else str(per_group)
        radius = engines if per_group is None else min(per_group, engines)
        for gbps in args.wire_gbps:
            t = sync_seconds(
                total,
                reshard_s,
                gbps,
                run.weights.bucket_mib * 2**20,
                args.bucket_overhead_ms / 1e3,
                groups,
            )
            print(
                f"{k:>4} {groups:>6d} {radius:>20d} {gbps:>10g} {t['wire']:>8.2f} "
                f"{t['in_line']:>10.2f} {t['overlapped']:>13.2f}"
            )


if __name__ == "__main__":
    main()
