#!/usr/bin/env python
"""What the torch spec's context-parallel attention prepares per micro-batch
(models/chunked_attention.py): the masks it builds, their bytes in host memory, and the time
its inputs take, for one CP rank at the flagship's shape by default.

    python tools/bench_attention.py                  # Qwen3-30B-A3B, CP2, 9,216 tokens/rank
    python tools/bench_attention.py --sequences 4 --rank 1
    python tools/bench_attention.py --tokens 512 --layers 4 --attention   # also run it

Defaults: the flagship's layout (examples/qwen3_30b_a3b_lag8.yaml): CP2, 9,216 tokens per
rank, so a row of 18,432 tokens (--sequences equal sequences; one by default, the longest key
spans), and the model's 48 layers, 32 query and 4 KV heads of 128 (--model; TP1: a TP rank
holds heads / TP of them). CP rank 0 by default: it reads every key of its sequences.

Per micro-batch, as the learner's forward runs it: the row's chunk layout (cached on its
boundaries), then for each layer the keys and values of the whole CP group (random here, in
place of the all-gather) put in row order, and each zigzag chunk's causal bias: inside the
kernel where CUDA's flash or memory-efficient attention takes the call, else a corner of the
one lower-right tile the micro-batch shares (models/chunked_attention.py). The line

    CP attention masks per micro-batch: N built, X bytes on the host

counts the tiles built over all layers and the bytes of those in host memory (on a CPU the
device is the host). --attention also runs each layer's attention forward and backward
(small shapes: at the default shape a CPU needs minutes per layer).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.bias import CausalBias

from megatron_fr.models.chunked_attention import (
    MASKS,
    chunk_inputs,
    chunk_layout,
    chunked_causal_attention,
)
from megatron_fr.models.hf_config import load_hf_config, preset_names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="qwen3-30b-a3b",
        help=f"preset ({', '.join(preset_names())}), HF checkpoint dir, or config.json",
    )
    parser.add_argument("--tokens", type=int, default=9216, help="tokens per CP rank")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel size")
    parser.add_argument("--rank", type=int, default=0, help="the CP rank measured")
    parser.add_argument("--sequences", type=int, default=1, help="equal sequences per row")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--attention", action="store_true", help="run the attention too")
    return parser


def row_boundaries(tokens: int, cp: int, sequences: int) -> tuple[int, ...]:
    """A row of `sequences` equal sequences holding `tokens` x CP tokens."""
    width = tokens * cp
    if width % sequences or (width // sequences) % (2 * cp if cp > 1 else 1):
        raise SystemExit(f"{sequences} sequences of a {width}-token row do not split 2 x CP ways")
    return tuple(range(0, width + 1, width // sequences))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    spec = load_hf_config(args.model)
    layers = args.layers or spec.num_layers
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    boundaries = row_boundaries(args.tokens, args.cp, args.sequences)

    def draw(tokens: int, heads: int) -> torch.Tensor:
        return torch.randn(tokens, 1, heads, spec.head_dim, device=device, dtype=dtype)

    query = draw(args.tokens, spec.num_attention_heads)
    gathered = args.tokens * args.cp
    key, value = draw(gathered, spec.num_key_value_heads), draw(gathered, spec.num_key_value_heads)
    if args.attention:
        for x in (query, key, value):
            x.requires_grad_()
    built, host_bytes = MASKS.built, MASKS.host_bytes
    in_kernel, preparing, attending = 0, [], 0.0
    for _ in range(layers):
        started = time.perf_counter()
        layout = chunk_layout(boundaries, args.cp, args.rank)
        inputs = chunk_inputs(query, key, value, layout)
        synchronize(device)
        preparing.append(time.perf_counter() - started)
        in_kernel += sum(isinstance(bias, CausalBias) for *_, bias in inputs)
        if args.attention:
            started = time.perf_counter()
            output = chunked_causal_attention(query, key, value, layout, spec.head_dim**-0.5)
            output.backward(torch.ones_like(output))
            synchronize(device)
            attending += time.perf_counter() - started
    print(
        f"{args.model}, {layers} layers: CP{args.cp} rank {args.rank}, {args.tokens:,} tokens"
        f" per rank, rows of {args.sequences} sequence(s) ({len(layout.chunks)} chunks on this"
        f" rank), {args.dtype} on {device.type}"
    )
    print(
        f"CP attention masks per micro-batch: {MASKS.built - built} built,"
        f" {MASKS.host_bytes - host_bytes:,} bytes on the host"
    )
    print(f"chunk biases applied inside the kernel (CUDA lower-right causal): {in_kernel}")
    print(
        f"build time: first layer (chunk layout and the mask tile, if any) {preparing[0]:.3f} s;"
        f" all {layers} layers' attention inputs (row-ordered keys, chunk biases)"
        f" {sum(preparing):.3f} s"
    )
    if args.attention:
        print(f"attention forward and backward, {layers} layers: {attending:.3f} s")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
