"""Checkpoint conversion throughput vs copying the same bytes, and peak memory vs size.

In one run: writes a synthetic Qwen3-MoE-shaped HF checkpoint of about --target-gb (random
bf16 weights, 256 MB shards, the shapes the config implies), then times
  cp -r HF_DIR        vs  convert_checkpoint.py hf-to-megatron
  cp -r MEGATRON_DIR  vs  convert_checkpoint.py megatron-to-hf
each as its own process, and reads each process's peak RSS from the kernel (wait4). A process
that only imports megatron and starts its group is measured too, as the fixed cost. This
process imports nothing heavy (the checkpoint is written by a child), because a child's peak
RSS as the kernel reports it includes what it inherited from its parent at fork.

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
    h, experts, moe, heads = 1024, 32, 256, 16 * 64
    per_layer = h * (heads + 2 * 4 * 64) + heads * h + 2 * 64 + 2 * h + experts * h
    per_layer += experts * 3 * h * moe
    outer = 2 * 32768 * h + h
    layers = max(1, round((target_bytes / 2 - outer) / per_layer))
    return base | {"num_hidden_layers": layers}


def write_synthetic_checkpoint(directory: Path, config: dict) -> int:
    """Random bf16 tensors under the HF names and shapes the config implies; returns bytes."""
    import torch

    from megatron_fr.convert.checkpoint import expected_hf_tensors
    from megatron_fr.convert.hf_files import ShardedSafetensorsWriter
    from megatron_fr.models.hf_config import load_hf_config

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    generator = torch.Generator().manual_seed(0)
    writer = ShardedSafetensorsWriter(directory, max_shard_bytes=256 * 10**6)
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


FIXED_COST = (
    "from megatron_fr.parallel import state; state.initialize_single_process();"
    "from megatron.core import dist_checkpointing"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-gb", type=float, default=1.0, help="checkpoint size (1e9 B)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/bench_convert"))
    parser.add_argument("--out", type=Path, default=REPO / "bench_out" / "bench_convert.json")
    parser.add_argument("--write-checkpoint", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    config = synthetic_config(int(args.target_gb * 10**9))
    if args.write_checkpoint:  # the child that writes the synthetic checkpoint
        write_synthetic_checkpoint(args.write_checkpoint, config)
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    shutil.rmtree(args.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
