"""Weight sync on CPU: the reshard's throughput vs a memcpy of the same bytes and its peak
memory, the send pipelined against a model of the wire, the broadcast itself into SGLang's
receiving code, and a projection of the flagship's sync time.

Default: 2 gloo ranks hold a ~1 GB (bf16) Qwen3-MoE-shaped megatron model at EP2 (or --tp 2,
or --tp 2 --ep 2 on 4 ranks); every rank walks ``reshard_buckets`` (the shards' messages to
the stage's sender, the HF mapping and the bucketing the weight sync does, without a
transport) --repeats times after building the plan once (a sync reuses it). Printed: the best
walk against the best of as many copies of the same number of bytes (one tensor copy), per
bucket its seconds and the bytes the sender received from its peers, and the sender's peak
extra resident memory (the kernel's high-water mark, reset before each walk) against bucket
+ largest HF tensor. Resident memory includes what glibc keeps of freed blocks; run with
MALLOC_MMAP_THRESHOLD_=65536 (every block of 64 KiB or more mapped and unmapped on its own,
slower) to see the live tensors' peak alone.

--wire-gbps G: then the sync's bucket loop (weights/pipeline.py BucketSender) with a
transport that holds each bucket for bytes / G (a network link whose DMA costs the host no
CPU), one bucket after the other and overlapped; overlapped, peak memory is compared with
2 x bucket + largest tensor.

--receivers K: instead, the model's HF tensors, bucketed, broadcast over gloo from the
project's sender (engine/group.py) to K processes receiving with SGLang's
init_custom_process_group and WeightUpdater code (engine/sglang/source.py), as flattened
buckets and tensor by tensor.

--project: Qwen3-30B-A3B's sync time in its recipe's layout from the figures of the last
default run (tools/weight_sync_projection.py has the formula).

--broadcasts [MODEL]: instead, the broadcasts one sync makes for a model's HF tensor list
(default the flagship's, qwen3-30b-a3b; shapes from the meta model, nothing allocated), in
--bucket-mib buckets: one per tensor with weights.bucket_format tensors, one per bucket with
flattened, and which weights.bucket_format auto picks on NCCL and on gloo. Prints
"broadcasts per sync: N" for the auto default on NCCL.

    .venv/bin/python tools/bench_weight_sync.py                  # ~1 GB, 512 MiB buckets
    .venv/bin/python tools/bench_weight_sync.py --bucket-mib 128 --wire-gbps 8
    .venv/bin/python tools/bench_weight_sync.py --target-gb 0.2 --bucket-mib 64 --receivers 2
    .venv/bin/python tools/bench_weight_sync.py --project
    .venv/bin/python tools/bench_weight_sync.py --broadcasts
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from bench_convert import synthetic_config  # noqa: E402  (same synthetic model family)


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1))


class PeakMemory:
    """Extra resident memory at its high-water mark during a `with` block (freed memory the
    allocator kept from earlier blocks is handed back first, or reuse would hide it)."""

    def __enter__(self) -> PeakMemory:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        self.before = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc_info) -> None:
        self.extra = _status_kib("VmHWM") * 1024 - self.before


def received_bytes(plan, model) -> list[int]:
    """Per bucket: the bytes of the shards the sender receives from its peers."""
    params = dict(model.named_parameters())
    return [
        sum(params[f.param].nbytes * sum(r != plan.sender for r in f.holders) for f in b.window)
        for b in plan.buckets
    ]


def walk(model, plan, spec) -> tuple[float, list[float]]:
    """reshard_buckets to the end: total seconds and seconds per bucket (on the sender)."""
    from megatron_fr.weights.reshard import reshard_buckets

    started = last = time.monotonic()
    per_bucket = []
    for bucket in reshard_buckets(model, plan, spec):
        per_bucket.append(time.monotonic() - last)
        del bucket  # as the sync does: each bucket is dropped before the next is built
        last = time.monotonic()
    return time.monotonic() - started, per_bucket


def send_over_wire(model, plan, spec, wire_gbps: float, overlap: bool) -> float:
    """The sync's bucket loop with a wire that takes bytes / wire_gbps per bucket."""
    from megatron_fr.weights.pipeline import BucketSender
    from megatron_fr.weights.reshard import reshard_buckets

    def wire(bucket) -> None:
        time.sleep(sum(t.nbytes for _, t in bucket) * 8 / (wire_gbps * 1e9))

    started = time.monotonic()
    with BucketSender(wire, overlap) as sender:
        for bucket in reshard_buckets(model, plan, spec):
            sender.submit(bucket)
            del bucket
        sender.finish()
    return time.monotonic() - started


def bench_on_rank(
    rank: int,
    world_size: int,
    config: dict,
    tp: int,
    ep: int,
    bucket_bytes: int,
    repeats: int,
    wire_gbps: float,
) -> dict:
    from megatron_fr.config import ParallelConfig
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state
    from megatron_fr.weights.plan import build_plan

    parallel = ParallelConfig(tensor=tp, expert=ep, sequence_parallel=tp > 1)
    state.initialize(parallel, seed=0)
    spec = load_hf_config(config)
    model = build_gpt_model(spec, parallel, params_dtype=torch.bfloat16, initialize=False)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    started = time.monotonic()
    plan = build_plan(model, spec, bucket_bytes)
    result = dict(
        plan_s=time.monotonic() - started,
        received=received_bytes(plan, model),
        bucket_bytes=[b.nbytes for b in plan.buckets],
        largest_tensor_bytes=plan.largest_tensor_bytes,
        reshard_s=float("inf"),
        walks_s=[],
    )
    for _ in range(repeats):
        with PeakMemory() as peak:
            seconds, per_bucket = walk(model, plan, spec)
        result["walks_s"].append(seconds)
        if seconds < result["reshard_s"]:
            result.update(reshard_s=seconds, per_bucket_s=per_bucket, peak_extra_bytes=peak.extra)
    for overlap in (False, True) if wire_gbps else ():
        with PeakMemory() as peak:
            seconds = send_over_wire(model, plan, spec, wire_gbps, overlap)
        result[f"wire_overlap_{overlap}"] = dict(seconds=seconds, peak_extra_bytes=peak.extra)
    result["memcpy_s"] = memcpy_seconds(sum(result["bucket_bytes"]), repeats)
    return result


def memcpy_seconds(nbytes: int, repeats: int) -> float:
    """The best of `repeats` copies of nbytes (bf16) into touched memory."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    target = torch.zeros_like(source)  # touched: the copy measures bandwidth, not page faults
    best = float("inf")
    for _ in range(repeats):
        started = time.monotonic()
        target.copy_(source)
        best = min(best, time.monotonic() - started)
    return best


def bucket_sizes(sizes: list[int], bucket_bytes: int) -> list[int]:
    """Tensors per bucket, by the sync's rule (the same as hf_buckets): a bucket closes when
    the next tensor would take it past bucket_bytes; a bigger tensor goes alone."""
    counts, size = [0], 0
    for nbytes in sizes:
        if counts[-1] and size + nbytes > bucket_bytes:
            counts.append(0)
            size = 0
        counts[-1] += 1
        size += nbytes
    return counts


def count_broadcasts(model: str, bucket_bytes: int) -> dict:
    """The broadcasts of one sync of `model`'s HF tensors in each bucket format (module
    docstring), printed; returned for the tests."""
    from megatron_fr.config.weights import WeightSyncConfig
    from megatron_fr.convert.checkpoint import expected_hf_tensors
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel.cpu_shims import install_cpu_shims

    install_cpu_shims()
    tensors = expected_hf_tensors(load_hf_config(model), torch.bfloat16)
    sizes = [meta.numel() * meta.element_size() for meta in tensors.values()]
    buckets = bucket_sizes(sizes, bucket_bytes)
    per_format = {"tensors": len(sizes), "flattened": len(buckets)}
    default = WeightSyncConfig()
    auto = {
        backend: "flattened" if default.flattened(backend) else "tensors"
        for backend in ("nccl", "gloo")
    }
    print(
        f"{model}: {len(sizes):,} HF tensors, {sum(sizes) / 1e9:.1f} GB in bf16; "
        f"{bucket_bytes / 2**20:g} MiB buckets: {len(buckets)}"
    )
    for name, count in per_format.items():
        print(f"  weights.bucket_format {name}: {count:,} broadcasts per sync")
    print(
        f"  weights.bucket_format {default.bucket_format} (the default): {auto['nccl']} on "
        f"NCCL (SGLang on GPUs), {auto['gloo']} on gloo (the CPU engine)"
    )
    print(f"broadcasts per sync: {per_format[auto['nccl']]:,}")
    return dict(per_format, auto=auto, bytes=sum(sizes))


def hf_buckets(config: dict, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's HF tensors (random bf16), in the sync's buckets (same rule as reshard)."""
    from megatron_fr.convert.checkpoint import expected_hf_tensors
    from megatron_fr.models.hf_config import load_hf_config

    buckets, size = [[]], 0
    for name, meta in expected_hf_tensors(load_hf_config(config), torch.bfloat16).items():
        tensor = torch.randn(meta.shape).to(torch.bfloat16)
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += nbytes
    return buckets


def receive_all(tp_rank: int, world: int, port: int, plan: list, results) -> None:
    """One receiver: SGLang's join and receive code, every bucket in both formats."""
    from megatron_fr.engine.sglang.source import DistributedReceiver

    receiver = DistributedReceiver(tp_rank=tp_rank)
    receiver.join("127.0.0.1", port, 1, world, "bench", "gloo")
    for load_format in ("flattened_bucket", None):
        for names, dtypes, shapes in plan:
            receiver.receive(names, dtypes, shapes, "bench", load_format)
    results.put(tp_rank)


def bench_broadcast(config: dict, bucket_bytes: int, receivers: int) -> dict:
    import torch.multiprocessing as mp

    from megatron_fr.engine.group import create_weight_update_group
    from megatron_fr.utils.net import free_port
    from megatron_fr.weights.transports.distributed import dtype_name, flatten_bucket

    buckets = hf_buckets(config, bucket_bytes)
    plan = [
        ([n for n, _ in b], [dtype_name(t) for _, t in b], [list(t.shape) for _, t in b])
        for b in buckets
    ]
    ctx, port, world = mp.get_context("spawn"), free_port(), receivers + 1
    results = ctx.Queue()
    procs = [
        ctx.Process(target=receive_all, args=(r, world, port, plan, results))
        for r in range(receivers)
    ]
    for proc in procs:
        proc.start()
    group = create_weight_update_group("127.0.0.1", port, world, "bench", "gloo", 600)
    seconds = {}
    for mode in ("flattened", "per_tensor"):
        started = time.monotonic()
        for bucket in buckets:
            if mode == "flattened":
                group.broadcast(flatten_bucket(bucket))
            else:
                for _, tensor in bucket:
                    group.broadcast(tensor)
        seconds[mode] = time.monotonic() - started
    for _ in procs:
        results.get(timeout=600)
    for proc in procs:
        proc.join(timeout=60)
    group.destroy()
    total = sum(t.numel() * t.element_size() for b in buckets for _, t in b)
    tensors = sum(len(b) for b in buckets)
    return dict(
        bytes=total,
        buckets=len(buckets),
        tensors=tensors,
        receivers=receivers,
        **{f"{mode}_s": value for mode, value in seconds.items()},
    )


def report_broadcast(r: dict, out: Path) -> None:
    print(
        f"{r['bytes'] / 1e9:.3f} GB in {r['buckets']} buckets ({r['tensors']} tensors) to "
        f"{r['receivers']} receivers (SGLang's receive code), gloo"
    )
    for mode in ("flattened", "per_tensor"):
        seconds = r[f"{mode}_s"]
        print(
            f"{mode + ':':12s} {seconds:.2f} s ({r['bytes'] / seconds / 1e9:.2f} GB/s, "
            f"{seconds / r['buckets'] * 1e3:.0f} ms per bucket)"
        )
    print(f"ratio per-tensor / flattened: {r['per_tensor_s'] / r['flattened_s']:.1f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))


def report(r: dict, title: str, bucket_bytes: int, wire_gbps: float) -> None:
    total, buckets = sum(r["bucket_bytes"]), len(r["bucket_bytes"])
    print(title)
    print(
        f"HF bytes produced:     {total / 1e9:.3f} GB in {buckets} buckets; the sender "
        f"received {sum(r['received']) / 1e9:.3f} GB of them from its peers"
    )
    print(f"plan (once per run):   {r['plan_s']:.2f} s")
    for what, seconds in (("reshard + bucket", r["reshard_s"]), ("memcpy", r["memcpy_s"])):
        print(f"{what + ':':22s} {seconds:.2f} s ({total / seconds / 1e9:.2f} GB/s)")
    print(
        f"reshard / memcpy bandwidth: {r['memcpy_s'] / r['reshard_s']:.2f} (walks: "
        f"{', '.join(f'{s:.2f}' for s in r['walks_s'])} s)"
    )
    for k, (seconds, size, got) in enumerate(
        zip(r["per_bucket_s"], r["bucket_bytes"], r["received"], strict=True)
    ):
        print(
            f"  bucket {k}: {size / 1e6:7.1f} MB ({got / 1e6:6.1f} MB received) in {seconds:.3f} s"
        )
    bound, peak = bucket_bytes + r["largest_tensor_bytes"], r["peak_extra_bytes"]
    print(
        f"peak extra memory:     {peak / 2**20:.0f} MiB vs bucket + largest tensor "
        f"{bound / 2**20:.0f} MiB (ratio {peak / bound:.2f})"
    )
    if not wire_gbps:
        return
    wire_s = total * 8 / (wire_gbps * 1e9)
    print(f"with a {wire_gbps:g} Gb/s wire ({wire_s:.2f} s for these bytes):")
    bound = 2 * bucket_bytes + r["largest_tensor_bytes"]
    for overlap, name in ((False, "one after the other"), (True, "overlapped")):
        w = r[f"wire_overlap_{overlap}"]
        print(
            f"  {name + ':':20s} {w['seconds']:.2f} s, peak extra "
            f"{w['peak_extra_bytes'] / 2**20:.0f} MiB"
        )
    peak = r["wire_overlap_True"]["peak_extra_bytes"]
    print(
        f"  sum / max of reshard and wire: {r['reshard_s'] + wire_s:.2f} s / "
        f"{max(r['reshard_s'], wire_s):.2f} s; overlapped peak vs 2 x bucket + largest "
        f"{bound / 2**20:.0f} MiB: ratio {peak / bound:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--target-gb", type=float, default=1.0)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="tensor parallel")
    parser.add_argument("--ep", type=int, default=2, choices=(1, 2), help="expert parallel")
    parser.add_argument("--repeats", type=int, default=3, help="walks (and copies); the best")
    parser.add_argument(
        "--wire-gbps",
        type=float,
        default=0.0,
        help="also the bucket loop with a wire of this many Gb/s",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "bench_weight_sync.json")
    parser.add_argument(
        "--receivers",
        type=int,
        default=0,
        help="instead: broadcast the buckets to this many SGLang-code receivers (GB/s)",
    )
    parser.add_argument(
        "--project",
        action="store_true",
        help="instead: project Qwen3-30B-A3B's sync time from --out (its own options, e.g. "
        "--gather-gbps, --bucket-overhead-ms: tools/weight_sync_projection.py --help)",
    )
    parser.add_argument(
        "--broadcasts",
        nargs="?",
        const="qwen3-30b-a3b",
        help="instead: count the broadcasts per sync for this model's tensors (a preset, HF "
        "dir or config.json; default qwen3-30b-a3b)",
    )
    args, rest = parser.parse_known_args()
    if args.broadcasts:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        count_broadcasts(args.broadcasts, args.bucket_mib * 2**20)
        return
    if args.project:
        from weight_sync_projection import main as project

        project([str(args.out), *rest])
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    config = synthetic_config(int(args.target_gb * 10**9))
    bucket_bytes = args.bucket_mib * 2**20
    if args.receivers:
        result = bench_broadcast(config, bucket_bytes, args.receivers)
        report_broadcast(result, args.out.with_name("bench_weight_broadcast.json"))
        return
    from megatron_fr.parallel.spawn import run_on_ranks

    world = args.tp * args.ep
    if world < 2:
        parser.error("--tp x --ep must be at least 2 (one stage sender and a peer)")
    results = run_on_ranks(
        bench_on_rank,
        world,
        config,
        args.tp,
        args.ep,
        bucket_bytes,
        args.repeats,
        args.wire_gbps,
        timeout_s=1800,
        threads_per_rank=1,
    )
    r, layout = results[0], f"TP{args.tp}xEP{args.ep}"
    title = (
        f"{config['num_hidden_layers']}-layer qwen3_moe at {layout}, bf16, {world} ranks "
        f"x 1 thread, best of {args.repeats}"
    )
    report(r, title, bucket_bytes, args.wire_gbps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"layout": layout, "tp": args.tp, "ep": args.ep, "bucket_mib": args.bucket_mib, **r}
    args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
