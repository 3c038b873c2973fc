"""Checkpoint conversion and parallel HF load/export: throughput vs copying the same bytes,
and peak memory vs size.

In one run: writes a synthetic Qwen3-MoE-shaped HF checkpoint of about --target-gb (random
bf16 weights, 256 MB shards, the shapes the config implies), then times
  cp -r HF_DIR        vs  convert_checkpoint.py hf-to-megatron
  cp -r MEGATRON_DIR  vs  convert_checkpoint.py megatron-to-hf
each as its own process, and reads each process's peak RSS from the kernel (wait4). A process
that only imports megatron and starts its group is measured too, as the fixed cost. This
process imports nothing heavy (the checkpoint is written by a child), because a child's peak
RSS as the kernel reports it includes what it inherited from its parent at fork.

Then the direct paths a job's ranks use (convert/parallel_load, parallel_export), on 1 rank
and on 2 ranks (EP2 and TP2): every rank builds its model stage, loads its slices of the HF
files, then all export the model back to HF. Per rank: seconds and GB/s of the load (bytes
read / load time), of the export (bytes written / export time), and peak RSS above the rank's
RSS before its model was built, compared with its shard (its parameter bytes) plus one
decoder layer.

    .venv/bin/python tools/bench_convert.py                 # ~1 GB, results in bench_out/
    .venv/bin/python tools/bench_convert.py --target-gb 0.2 # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def synthetic_config(target_bytes: int) -> dict:
    """A Qwen3-MoE config whose bf16 checkpoint is close to target_bytes (layers scale it)."""
    base = dict(
        model_type="qwen3_moe",
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=2048,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=256,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    outer = 2 * base["vocab_size"] * base["hidden_size"] + base["hidden_size"]
    layers = max(1, round((target_bytes / 2 - outer) / layer_parameters(base)))
    return base | {"num_hidden_layers": layers}


def layer_parameters(config: dict) -> int:
    """Parameters of one decoder layer: attention, q/k norms, 2 norms, router, experts."""
    h, experts = config["hidden_size"], config["num_experts"]
    heads = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    attention = h * (heads + 2 * kv) + heads * h + 2 * config["head_dim"] + 2 * h
    return attention + experts * h + experts * 3 * h * config["moe_intermediate_size"]


def write_synthetic_checkpoint(directory: Path, config: dict) -> int:
    """Random bf16 tensors under the HF names and shapes the config implies; returns bytes."""
    import torch

    from megatron_fr.convert.checkpoint import expected_hf_tensors
    from megatron_fr.convert.hf_files import ShardedSafetensorsWriter
    from megatron_fr.models.hf_config import load_hf_config

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    writer = ShardedSafetensorsWriter(directory, max_shard_bytes=SHARD_BYTES)
    for name, meta in expected_hf_tensors(load_hf_config(config), torch.bfloat16).items():
        tensor = torch.randn(meta.shape, generator=generator).mul_(0.02).to(torch.bfloat16)
        writer.add(name, tensor)
    writer.finish()
    return writer.total_bytes


def timed(command: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process; raises if it fails."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.monotonic() - started
    stderr = process.stderr.read().decode()
    process.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{command[:4]} failed:\n{stderr[-3000:]}")
    return elapsed, usage.ru_maxrss * 1024


def convert(*args: str | Path) -> list[str]:
    return [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), *map(str, args)]


SHARD_BYTES = 256 * 10**6
"""Shard size of the synthetic checkpoint and of the exports (a writer holds one shard)."""
LAYOUTS = {"1 rank": (1, {}), "2 ranks EP2": (2, {"expert": 2}), "2 ranks TP2": (2, {"tensor": 2})}


def _rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _direct_on_rank(rank: int, world_size: int, hf_dir: str, layout: dict, out: str) -> dict:
    """Load this rank's slices of hf_dir into its model stage, then export all to `out`."""
    import torch

    from megatron_fr.config import ParallelConfig
    from megatron_fr.convert.parallel_export import export_hf_from_model
    from megatron_fr.convert.parallel_load import load_hf_into_model
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    parallel = ParallelConfig(sequence_parallel=layout.get("tensor", 1) > 1, **layout)
    state.initialize(parallel, seed=0)
    spec = load_hf_config(hf_dir)
    before_model = _rss_bytes()
    model = build_gpt_model(spec, parallel, params_dtype=torch.bfloat16, initialize=False)
    load = load_hf_into_model(model, hf_dir, spec, progress=False)
    after_load = _rss_bytes()
    config_text = (Path(hf_dir) / "config.json").read_text()
    export = export_hf_from_model(
        model, spec, out, config_text=config_text, max_shard_bytes=SHARD_BYTES, progress=False
    )
    return {
        "shard_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "load_seconds": load.seconds,
        "bytes_read": load.bytes_read,
        "export_seconds": export.seconds,
        "bytes_written": export.bytes,
        "rss_before_model": before_model,
        "peak_rss_after_load": after_load,
        "peak_rss": _rss_bytes(),
    }


def _run_direct(hf_dir: Path, layout_name: str, out: Path, report: Path) -> None:
    """The child that runs one layout on its ranks and writes their figures as JSON."""
    from megatron_fr.parallel.spawn import run_on_ranks

    ranks, layout = LAYOUTS[layout_name]
    per_rank = run_on_ranks(_direct_on_rank, ranks, str(hf_dir), layout, str(out), timeout_s=3600)
    report.write_text(json.dumps(per_rank, indent=2))


def direct_rows(args: argparse.Namespace, hf: Path, config: dict, size: int) -> dict:
    """Run every layout (each in its own process tree) and print its per-rank figures; `cp -r`
    of the same files is timed again just before each layout (this machine's load varies)."""
    layer = 2 * layer_parameters(config)  # bf16
    results = {}
    header = [
        "rank",
        "load s",
        "GB/s",
        "x cp",
        "RSS/(shard+layer)",
        "export s",
        "GB/s",
        "peak RSS GiB",
    ]
    widths = [4, 7, 6, 5, 17, 8, 6, 12]
    print(
        f"\n{'direct load / export':20s}",
        *(f"{h:>{w}s}" for h, w in zip(header, widths, strict=True)),
    )
    for index, name in enumerate(LAYOUTS):
        report = args.work_dir / f"direct{index}.json"
        command = [sys.executable, __file__, "--target-gb", str(args.target_gb), "--direct", name]
        export_to = args.work_dir / f"export{index}"
        command += ["--hf-dir", str(hf), "--export-to", str(export_to), "--report", str(report)]
        subprocess.run(["sync"], check=True)  # no earlier write-back in this layout's time
        copy_seconds, _ = timed(["cp", "-r", str(hf), str(args.work_dir / "hf_copy_again")])
        shutil.rmtree(args.work_dir / "hf_copy_again")
        copy_rate = size / copy_seconds / 10**9
        subprocess.run(["sync"], check=True)
        seconds, _ = timed(command)
        per_rank = json.loads(report.read_text())
        results[name] = {"wall_seconds": seconds, "cp_seconds": copy_seconds, "ranks": per_rank}
        for rank, row in enumerate(per_rank):
            rate = row["bytes_read"] / row["load_seconds"] / 10**9
            write_rate = row["bytes_written"] / row["export_seconds"] / 10**9
            load_rss = row["peak_rss_after_load"] - row["rss_before_model"]
            bound = load_rss / (row["shard_bytes"] + layer)
            print(
                f"{name:20s} {rank:4d} {row['load_seconds']:7.2f} {rate:6.3f} "
                f"{rate / copy_rate:5.2f} {bound:17.2f} {row['export_seconds']:8.2f} "
                f"{write_rate:6.3f} {row['peak_rss'] / GIB:12.2f}"
            )
        written = sum(row["bytes_written"] for row in per_rank)
        slowest = max(row["export_seconds"] for row in per_rank)
        print(
            f"{name:20s} export, all ranks: {written / slowest / 10**9:.3f} GB/s; "
            f"process tree {seconds:.1f} s wall; cp -r just before: {copy_rate:.3f} GB/s"
        )
    return results


FIXED_COST = (
    "from megatron_fr.parallel.cpu_shims import install_cpu_shims; install_cpu_shims();"
    "from megatron_fr.parallel import state; state.initialize_single_process();"
    "from megatron.core import dist_checkpointing"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-gb", type=float, default=1.0, help="checkpoint size (1e9 B)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_convert"))
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "bench_convert.json")
    parser.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)
    for hidden in ("--direct", "--hf-dir", "--export-to", "--report"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = synthetic_config(int(args.target_gb * 10**9))
    if args.write_checkpoint:  # the child that writes the synthetic checkpoint
        write_synthetic_checkpoint(args.write_checkpoint, config)
        return
    if args.direct:  # the child that runs one layout of the direct paths
        _run_direct(Path(args.hf_dir), args.direct, Path(args.export_to), Path(args.report))
        return

    shutil.rmtree(args.work_dir, ignore_errors=True)
    hf, megatron, back = (args.work_dir / name for name in ("hf", "megatron", "back"))
    subprocess.run(
        [sys.executable, __file__, "--target-gb", str(args.target_gb), "--write-checkpoint", hf],
        check=True,
        stderr=subprocess.DEVNULL,
    )
    size = sum(file.stat().st_size for file in hf.glob("*.safetensors"))
    print(f"synthetic qwen3_moe, {config['num_hidden_layers']} layers: {size / 10**9:.3f} GB")

    rows = {
        "fixed cost (import megatron + group)": timed([sys.executable, "-c", FIXED_COST]),
        "cp -r hf": timed(["cp", "-r", str(hf), str(args.work_dir / "hf_copy")]),
        "hf-to-megatron": timed(convert("hf-to-megatron", "--hf-dir", hf, "--out", megatron)),
        "cp -r megatron": timed(["cp", "-r", str(megatron), str(args.work_dir / "meg_copy")]),
        "megatron-to-hf": timed(
            convert("megatron-to-hf", "--megatron-dir", megatron, "--out", back)
        ),
    }
    fixed_s = rows["fixed cost (import megatron + group)"][0]
    results = {"checkpoint_bytes": size, "layers": config["num_hidden_layers"], "rows": {}}
    print(f"{'':40s} {'wall s':>8s} {'GB/s':>7s} {'peak RSS GiB':>13s} {'RSS/size':>9s}")
    for name, (seconds, rss) in rows.items():
        rate = size / seconds / 10**9
        print(f"{name:40s} {seconds:8.2f} {rate:7.3f} {rss / GIB:13.2f} {rss / size:9.2f}")
        results["rows"][name] = {"seconds": seconds, "peak_rss_bytes": rss}
    for direction, copy in (("hf-to-megatron", "cp -r hf"), ("megatron-to-hf", "cp -r megatron")):
        seconds = rows[direction][0]
        ratio, net = seconds / rows[copy][0], (seconds - fixed_s) / rows[copy][0]
        results[f"{direction}_vs_cp"] = ratio
        print(f"{direction}: {ratio:.1f}x the cp time ({net:.1f}x without the fixed cost)")
    for name in ("hf-to-megatron", "megatron-to-hf"):
        extra = rows[name][1] - rows["fixed cost (import megatron + group)"][1]
        results[f"{name}_extra_rss_over_size"] = extra / size
        print(f"{name}: peak RSS above the fixed cost = {extra / size:.2f} x checkpoint size")
    results["direct"] = direct_rows(args, hf, config, size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
