"""tools/bench_attention.py at small shapes on the CPU: the masks it reports are the one
lower-right tile the zigzag split calls for, or none where every chunk is square."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str) -> str:
    command = [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--device", "cpu"]
    result = subprocess.run(
        [*command, "--dtype", "float32", *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    "args, tile_bytes",
    [
        # CP2, one 512-token sequence: chunks of 128. Rank 0 holds chunks 0 (square: causal,
        # no bias) and 3 (128 queries x all 512 keys): one 128 x 512 fp32 tile for 3 layers.
        (["--tokens", "256", "--layers", "3", "--attention"], 128 * 512 * 4),
        # Rank 1: chunks 1 (128 x 256) and 2 (128 x 384), both corners of a 128 x 384 tile.
        (["--tokens", "256", "--layers", "3", "--rank", "1"], 128 * 384 * 4),
        # CP1: each sequence is one square chunk, attended with is_causal: no mask at all.
        (["--tokens", "256", "--layers", "3", "--cp", "1", "--sequences", "2"], 0),
    ],
)
def test_bench_attention_counts_the_masks_a_micro_batch_builds(args, tile_bytes):
    out = bench(*args)
    built = 1 if tile_bytes else 0
    line = f"CP attention masks per micro-batch: {built} built, {tile_bytes:,} bytes on the host"
    assert line in out, out
    assert "chunk biases applied inside the kernel (CUDA lower-right causal): 0" in out, out
    assert "build time: first layer" in out, out
    assert ("attention forward and backward, 3 layers" in out) == ("--attention" in args), out


def test_a_micro_batch_reads_its_row_boundaries_on_the_host_once_not_per_layer():
    """The learner's PackedSeqParams carry the boundaries as host ints: no layer copies
    cu_seqlens back (0 syncs, forward and backward included); megatron's plain
    PackedSeqParams cost one read per layer, which the count sees (4 layers: 4)."""
    args = ["--tokens", "256", "--layers", "4", "--sequences", "2"]
    assert "host syncs per micro-batch: 0" in bench(*args, "--attention")
    out = bench(*args, "--device-boundaries")
    assert "host syncs per micro-batch: 4 (tolist x 4)" in out, out
