"""Reshard + bucket throughput vs a memcpy of the same bytes, and peak extra memory; or
(--receivers K) the broadcast itself into K processes receiving with SGLang's own code.

In one run, on 2 gloo ranks holding a ~1 GB (bf16) Qwen3-MoE-shaped megatron model at EP2
(or --tp 2): every rank walks ``iter_hf_buckets`` (the gathers, the HF mapping and the
bucketing the weight sync does, without a transport), timed against copying the same number
of bytes with one tensor copy. Peak extra resident memory during the walk (the kernel's
high-water mark, reset before it) is compared with bucket size + largest HF tensor.

With --receivers K the same model's HF tensors, bucketed, are broadcast over gloo from the
project's sender (engine/group.py) to K receiver processes that join and receive with
SGLang's init_custom_process_group and WeightUpdater receive methods (engine/sglang_source.py),
once as flattened buckets (one broadcast per bucket, load_format "flattened_bucket") and once
tensor by tensor: GB/s of each and their ratio.

    .venv/bin/python tools/bench_weight_sync.py                  # ~1 GB, 512 MiB buckets
    .venv/bin/python tools/bench_weight_sync.py --target-gb 0.2 --bucket-mib 64
    .venv/bin/python tools/bench_weight_sync.py --target-gb 0.2 --bucket-mib 64 --receivers 2
"""

from __future__ import annotations

import argparse
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


def bench_on_rank(rank: int, world_size: int, config: dict, tp: int, bucket_bytes: int) -> dict:
    from megatron_fr.config import ParallelConfig
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state
    from megatron_fr.weights.reshard import iter_hf_buckets

    parallel = ParallelConfig(tensor=tp, expert=world_size // tp, sequence_parallel=tp > 1)
    state.initialize(parallel, seed=0)
    spec = load_hf_config(config)
    model = build_gpt_model(spec, parallel, params_dtype=torch.bfloat16, initialize=False)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)

    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS") * 1024
    started = time.monotonic()
    total = largest = buckets = 0
    for bucket in iter_hf_buckets(model, spec, bucket_bytes):
        buckets += 1
        for _, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            total, largest = total + nbytes, max(largest, nbytes)
        del bucket  # as the sync does: the next bucket is built while this one is dropped
    reshard_s = time.monotonic() - started
    peak_extra = _status_kib("VmHWM") * 1024 - before
    del model

    source = torch.empty(total // 2, dtype=torch.bfloat16).normal_()
    target = torch.zeros_like(source)  # touched: the copy measures bandwidth, not page faults
    started = time.monotonic()
    target.copy_(source)
    memcpy_s = time.monotonic() - started
    return dict(
        hf_bytes=total, largest_tensor_bytes=largest, buckets=buckets, reshard_s=reshard_s,
        memcpy_s=memcpy_s, peak_extra_bytes=peak_extra,
    )  # fmt: skip


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
    from megatron_fr.engine.sglang_source import DistributedReceiver

    receiver = DistributedReceiver(tp_rank=tp_rank)
    receiver.join("127.0.0.1", port, 1, world, "bench", "gloo")
    for load_format in ("flattened_bucket", None):
        for names, dtypes, shapes in plan:
            receiver.receive(names, dtypes, shapes, "bench", load_format)
    results.put(tp_rank)


def bench_broadcast(config: dict, bucket_bytes: int, receivers: int) -> dict:
    import torch.multiprocessing as mp

    from megatron_fr.engine.group import create_weight_update_group
    from megatron_fr.parallel.spawn import free_port
    from megatron_fr.weights.transports.distributed import dtype_name, flatten_bucket

    buckets = hf_buckets(config, bucket_bytes)
    plan = [([n for n, _ in b], [dtype_name(t) for _, t in b], [list(t.shape) for _, t in b])
            for b in buckets]  # fmt: skip
    ctx, port, world = mp.get_context("spawn"), free_port(), receivers + 1
    results = ctx.Queue()
    procs = [ctx.Process(target=receive_all, args=(r, world, port, plan, results))
             for r in range(receivers)]  # fmt: skip
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
    return dict(bytes=total, buckets=len(buckets), tensors=tensors, receivers=receivers,
                **{f"{mode}_s": value for mode, value in seconds.items()})  # fmt: skip


def report_broadcast(r: dict, out: Path) -> None:
    print(f"{r['bytes'] / 1e9:.3f} GB in {r['buckets']} buckets ({r['tensors']} tensors) to "
          f"{r['receivers']} receivers (SGLang's receive code), gloo")  # fmt: skip
    for mode in ("flattened", "per_tensor"):
        seconds = r[f"{mode}_s"]
        print(f"{mode + ':':12s} {seconds:.2f} s ({r['bytes'] / seconds / 1e9:.2f} GB/s, "
              f"{seconds / r['buckets'] * 1e3:.0f} ms per bucket)")  # fmt: skip
    print(f"ratio per-tensor / flattened: {r['per_tensor_s'] / r['flattened_s']:.1f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-gb", type=float, default=1.0)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1, choices=(1, 2), help="1: EP2, 2: TP2")
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "bench_weight_sync.json")
    parser.add_argument(
        "--receivers", type=int, default=0,
        help="instead: broadcast the buckets to this many SGLang-code receivers (GB/s)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.receivers:
        config = synthetic_config(int(args.target_gb * 10**9))
        result = bench_broadcast(config, args.bucket_mib * 2**20, args.receivers)
        report_broadcast(result, args.out.with_name("bench_weight_broadcast.json"))
        return

    from megatron_fr.parallel.spawn import run_on_ranks

    config = synthetic_config(int(args.target_gb * 10**9))
    bucket_bytes = args.bucket_mib * 2**20
    results = run_on_ranks(
        bench_on_rank, 2, config, args.tp, bucket_bytes, timeout_s=1800, threads_per_rank=1
    )
    r = results[0]
    layout = "TP2" if args.tp == 2 else "EP2"
    bound = bucket_bytes + r["largest_tensor_bytes"]
    print(f"{config['num_hidden_layers']}-layer qwen3_moe at {layout}, bf16, 2 ranks x 1 thread")
    print(f"HF bytes produced:     {r['hf_bytes'] / 10**9:.3f} GB in {r['buckets']} buckets")
    for what, seconds in (("reshard + bucket", r["reshard_s"]), ("memcpy", r["memcpy_s"])):
        print(f"{what + ':':22s} {seconds:.2f} s ({r['hf_bytes'] / seconds / 1e9:.2f} GB/s)")
    print(f"ratio reshard/memcpy:  {r['reshard_s'] / r['memcpy_s']:.1f}")
    print(
        f"peak extra memory:     {r['peak_extra_bytes'] / 2**20:.0f} MiB vs bucket + largest "
        f"tensor {bound / 2**20:.0f} MiB (ratio {r['peak_extra_bytes'] / bound:.2f})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"layout": layout, "bucket_bytes": bucket_bytes, **r}, indent=2))


if __name__ == "__main__":
    main()
