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

The row reaches the layers as the learner hands it over: a packed micro-batch's
PackedSeqParams (learner/micro_batches.py: MicroBatch.packed_seq_params, cu_seqlens on the
device) read by each layer through models/attention.py's row_boundaries. The line

    host syncs per micro-batch: N

counts the calls that copy a device tensor's values to the host (Tensor.tolist, item, cpu,
numpy, and int/float/bool of a tensor) from the micro-batch's PackedSeqParams through every
layer's attention inputs, by patching those methods for the run; on a CPU every tensor is
counted, as it would sit on the GPU. --device-boundaries hands the layers megatron's plain
PackedSeqParams (no host copy of the boundaries): each layer then reads cu_seqlens back. The
count sees reads made from Python; a sync inside a torch kernel (a data-dependent shape) is
not a method call and is not counted (on a GPU, torch.cuda.set_sync_debug_mode("warn") shows
those).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import time
from collections.abc import Iterator

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
    parser.add_argument(
        "--device-boundaries",
        action="store_true",
        help="megatron's plain PackedSeqParams: every layer reads cu_seqlens from the device",
    )
    return parser


SYNCING = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")
"""Tensor methods that copy values to the host (a device-to-host sync on a GPU)."""


@contextlib.contextmanager
def count_host_syncs(device: torch.device) -> Iterator[list[str]]:
    """Patch the SYNCING methods of torch.Tensor for the block; the list fills with the name of
    each call on a tensor of `device` (on a CPU: every tensor, standing in for the GPU's)."""
    calls: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def counted(name: str, method):
        def wrapper(tensor, *args, **kwargs):
            if tensor.device.type == device.type:
                calls.append(name)
            return method(tensor, *args, **kwargs)

        return wrapper

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield calls
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


def packed_params(boundaries: tuple[int, ...], device: torch.device, host: bool):
    """The packed row's PackedSeqParams as the learner makes it for a micro-batch (host=True:
    MicroBatch.packed_seq_params, cu_seqlens on the device and the boundaries kept on the
    host), or megatron's plain one with the same device tensors (host=False)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_fr.learner.micro_batches import MicroBatch

    cu = torch.tensor(boundaries, dtype=torch.int32).to(device)  # built on the host, moved
    longest = max(b - a for a, b in itertools.pairwise(boundaries))
    if not host:
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
    micro = MicroBatch(
        input_ids=torch.empty(0),
        positions=torch.empty(0),
        loss_batch=None,  # type: ignore[arg-type]  # not read here
        cu_seqlens=cu,
        max_seqlen=longest,
        boundaries=boundaries,
    )
    return micro.packed_seq_params()


def row_boundaries(tokens: int, cp: int, sequences: int) -> tuple[int, ...]:
    """A row of `sequences` equal sequences holding `tokens` x CP tokens."""
    width = tokens * cp
    if width % sequences or (width // sequences) % (2 * cp if cp > 1 else 1):
        raise SystemExit(f"{sequences} sequences of a {width}-token row do not split 2 x CP ways")
    return tuple(range(0, width + 1, width // sequences))


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from megatron_fr.parallel.cpu_shims import install_import_shims

    install_import_shims()  # megatron imports triton, which a CPU machine lacks
    from megatron_fr.models.attention import row_boundaries as attention_row_boundaries

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
    with count_host_syncs(device) as syncs:
        params = packed_params(boundaries, device, host=not args.device_boundaries)
    for _ in range(layers):
        started = time.perf_counter()
        with count_host_syncs(device) as calls:
            row = tuple(attention_row_boundaries(query, params, args.cp))  # as each layer does
            layout = chunk_layout(row, args.cp, args.rank)
            inputs = chunk_inputs(query, key, value, layout)
        syncs += calls
        synchronize(device)
        preparing.append(time.perf_counter() - started)
        in_kernel += sum(isinstance(bias, CausalBias) for *_, bias in inputs)
        if args.attention:
            started = time.perf_counter()
            with count_host_syncs(device) as calls:
                output = chunked_causal_attention(query, key, value, layout, spec.head_dim**-0.5)
                output.backward(torch.ones_like(output))
            syncs += calls
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
    kinds = ", ".join(f"{name} x {syncs.count(name)}" for name in sorted(set(syncs)))
    print(f"host syncs per micro-batch: {len(syncs)}" + (f" ({kinds})" if kinds else ""))
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
