#!/usr/bin/env python
"""The learner's speed and memory for one layer spec and one shape: tokens/s, model TFLOP/s,
peak memory, where a step's time goes, and the loss path's memory against the logits it
never builds.

    python tools/bench_learner.py --spec local                   # CPU: tiny Qwen3-MoE shapes
    python tools/bench_learner.py --spec torch --shape slice     # GPU: Qwen3-30B-A3B slice
    python tools/bench_learner.py --spec torch --shape slice --layers 4 --tokens 4096

Shapes: `tiny` (CPU) is Qwen3-MoE's structure at toy size (2 layers, hidden 128, 8 experts,
top-2, vocab 4,096, 2,048 tokens); `slice` is Qwen3-30B-A3B's real shapes (hidden 2048, 32
query / 4 KV heads of 128, 128 experts of width 768, top-8, vocab 151,936) with 8 layers and
16,384 tokens. One learner rank (TP1, EP1), bf16 on a GPU and fp32 on a CPU, trains on
trajectories whose lengths are drawn from a lognormal (median --median, sigma 0.8) and packed
into one micro-batch of --tokens tokens, gate off (every token contributes).

A step is Learner.train_step: the forward and backward of the micro-batch (the chunked loss
path included) and the distributed optimizer's Adam step. Model FLOPs per step, written out
(activation recompute is not counted, as in MFU):

    6 T P + sum over trajectories of 6 L q n^2
    P = L (h (q + 2 kv) + q h + k 3 h F + E h) + V h

with T the step's tokens, n each trajectory's tokens, L layers, h hidden, q = heads x
head_dim, kv = KV heads x head_dim, E experts of width F, top-k k, V vocabulary: the matmul
parameters a token passes through (attention projections, its k experts' three matrices,
the router, the output layer; not the embedding lookup), and causal attention's QK^T and AV
(2 q n^2 forward per layer, x3 with the backward). Model TFLOP/s = FLOPs per step / step time.

Where the time goes: the same inputs replayed through one layer's core attention and one
layer's MoE block (router, token dispatch, experts, combine), forward and backward, times
the layers; the loss path (output layer and scoring) forward and backward; the optimizer
step alone. "other" is the step's remainder (embedding, norms, projections, schedule).

Loss path memory: the chunked loss path (models/token_scores.py) on the step's tokens at
vocabulary 151,936 and the model's hidden size, forward and backward, counted tensor by
tensor (utils/tensor_memory.py); extra = its peak beyond its inputs and the two gradients it
returns (hidden states, weight), over T x 151,936 x 4 B, the fp32 logits of the micro-batch.
Peak memory of a step: the CUDA allocator's on a GPU, the process's peak resident set on a
CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import resource
import sys
import time

QWEN3_VOCAB = 151_936
TINY = dict(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    vocab_size=4096,
)
"""The tiny shape's overrides: a two-layer MoE of Qwen3-30B-A3B's architecture."""
SHAPES = {
    # name: (spec overrides of qwen3-30b-a3b, tokens, median trajectory length)
    "tiny": (TINY, 2048, 256),
    "slice": (dict(num_layers=8), 16384, 2048),
}


def model_flops(spec, lengths: list[int]) -> float:
    """Model FLOPs of one training step over trajectories of `lengths` (module docstring)."""
    h, q = spec.hidden_size, spec.num_attention_heads * spec.head_dim
    kv, k = spec.num_key_value_heads * spec.head_dim, spec.num_experts_per_tok
    per_layer = h * (q + 2 * kv) + q * h + k * 3 * h * spec.moe_intermediate_size
    per_layer += spec.num_experts * h
    params = spec.num_layers * per_layer + spec.vocab_size * h
    tokens = sum(n - 1 for n in lengths)
    return 6 * tokens * params + sum(6 * spec.num_layers * q * (n - 1) ** 2 for n in lengths)


def packed_lengths(tokens: int, median: float, seed: int) -> list[int]:
    """Trajectory lengths from a lognormal (sigma 0.8), as many as fill `tokens` model tokens
    (a trajectory of n tokens feeds n - 1); the last one cut to fill them exactly."""
    import torch

    generator, lengths, left = torch.Generator().manual_seed(seed), [], tokens
    while left > 0:
        draw = math.exp(math.log(median) + 0.8 * torch.randn(1, generator=generator).item())
        n = max(2, min(int(draw), left + 1))
        lengths.append(n)
        left -= n - 1
    return lengths


def trajectories(lengths: list[int], vocab: int, seed: int):
    """Random tokens, a quarter of each one prompt, behaviour log-probs near the uniform."""
    import torch

    from megatron_fr.buffer.trajectory import Trajectory

    generator, batch = torch.Generator().manual_seed(seed), []
    for index, n in enumerate(lengths):
        prompt = max(1, n // 4)
        tokens = torch.randint(0, vocab, (n,), generator=generator).tolist()
        mask = [False] * prompt + [True] * (n - prompt)
        behavior = [0.0] * prompt + [-math.log(vocab)] * (n - prompt)
        versions = [-1] * prompt + [0] * (n - prompt)
        batch.append(Trajectory(f"p{index}", tokens, mask, behavior, versions, float(index % 2)))
    return batch


def synchronized(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def timed(fn, device, repeats: int) -> float:
    """Mean seconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    started = synchronized(device)
    for _ in range(repeats):
        fn()
    return (synchronized(device) - started) / repeats


def captured_inputs(module):
    """A hook keeping the first (args, kwargs) `module` is called with, as fresh leaves."""
    import torch

    kept: dict = {}

    def fresh(value):
        if not isinstance(value, torch.Tensor):
            return value
        leaf = value.detach().clone()
        return leaf.requires_grad_(value.requires_grad or leaf.is_floating_point())

    def hook(_module, args, kwargs):
        if not kept:
            kept["args"] = tuple(fresh(a) for a in args)
            kept["kwargs"] = {key: fresh(v) for key, v in kwargs.items()}

    return kept, module.register_forward_pre_hook(hook, with_kwargs=True)


def forward_backward(module, inputs: dict):
    """fwd + bwd of `module` on captured inputs (a MoE block's output is (output, bias))."""
    import torch

    def run() -> None:
        output = module(*inputs["args"], **inputs["kwargs"])
        output = output[0] if isinstance(output, tuple) else output
        output.backward(torch.ones_like(output))

    return run


def build(args, spec):
    """One rank's learner of `args.spec` on `spec`, bf16 on a GPU and fp32 on a CPU."""
    import torch

    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.parallel.state import initialize_single_process

    initialize_single_process(ParallelConfig(), seed=0)
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    config = LearnerConfig(
        params_dtype=dtype,
        micro_batch_tokens=args.tokens,
        recompute=args.recompute,
        lr=1e-6,
        flash_reinforce=FlashReinforceConfig(delta=math.inf),
    )
    return Learner(spec, ParallelConfig(), config, total_steps=1_000_000, spec_kind=args.spec)


def breakdown(learner, batch, repeats: int) -> dict[str, float]:
    """Seconds of a step's parts (module docstring), from inputs captured during one step."""
    from megatron_fr.models.token_scores import TargetScores

    layer = learner.module.decoder.layers[0]
    hooks = {"attention": layer.self_attention.core_attention, "experts": layer.mlp}
    captures = {name: captured_inputs(module) for name, module in hooks.items()}
    final: dict = {}
    handle = learner.module.decoder.register_forward_hook(
        lambda _m, _a, out: final.setdefault("hidden", out.detach().clone())
    )
    learner.train_step(batch)
    for _, hook in captures.values():
        hook.remove()
    handle.remove()
    layers, device = learner.spec.num_layers, learner.device
    first = learner._micro_batches(learner.plan(batch), batch, 0, None)[0]
    targets = first.loss_batch.target_ids.to(device)
    scores = TargetScores(targets)
    hidden = final["hidden"].requires_grad_(True)
    loss = {
        "args": (),
        "kwargs": dict(hidden_states=hidden, output_layer=learner.module.output_layer),
    }
    attention = forward_backward(hooks["attention"], captures["attention"][0])
    experts = forward_backward(hooks["experts"], captures["experts"][0])
    parts = {
        "attention": layers * timed(attention, device, repeats),
        "experts with dispatch": layers * timed(experts, device, repeats),
        "loss": timed(forward_backward(scores, loss), device, repeats),
        "optimizer": timed(learner.optimizer.step, device, repeats),
    }
    learner.model.zero_grad_buffer()
    return parts


def loss_path_memory(hidden_size: int, tokens: int, device, dtype) -> float:
    """The loss path's peak extra memory over the micro-batch's fp32 logits at Qwen3's
    vocabulary (module docstring), on random hidden states, weights and targets."""
    import torch

    from megatron_fr.parallel.vocab_parallel import loss_path_extra_memory

    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, dtype=dtype, generator=generator)
    weight = (
        torch.randn(QWEN3_VOCAB, hidden_size, device=device, dtype=dtype, generator=generator)
        * hidden_size**-0.5
    )
    targets = torch.randint(0, QWEN3_VOCAB, (tokens,), device=device, generator=generator)
    return loss_path_extra_memory(hidden, weight, targets)


def peak_memory_gib(device) -> tuple[str, float]:
    import torch

    if device.type == "cuda":
        return "peak memory (CUDA allocator)", torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "peak memory (process resident set)", kib / 2**20


def run(args) -> list[tuple[str, str]]:
    import torch

    from megatron_fr.models.hf_config import load_hf_config

    overrides, tokens, median = SHAPES[args.shape]
    args.tokens = args.tokens or tokens
    if args.layers:
        overrides = {**overrides, "num_layers": args.layers}
    spec = dataclasses.replace(load_hf_config("qwen3-30b-a3b"), **overrides)
    lengths = packed_lengths(args.tokens, median, args.seed)
    batch = trajectories(lengths, spec.vocab_size, args.seed)
    learner = build(args, spec)
    device = learner.device
    learner.train_step(batch)  # warm-up: allocator, kernels' autotuning
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = timed(lambda: learner.train_step(batch), device, args.iterations)
    peak_name, peak = peak_memory_gib(device)
    parts = breakdown(learner, batch, args.iterations)
    parts["other"] = max(step - sum(parts.values()), 0.0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ratio = loss_path_memory(spec.hidden_size, args.tokens, device, dtype)
    rows = [
        (
            "shape",
            f"{args.shape}: {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"{spec.num_experts} experts top-{spec.num_experts_per_tok}, vocab "
            f"{spec.vocab_size}; {args.tokens} tokens in {len(lengths)} trajectories",
        ),
        ("spec", f"{learner.layer_spec} on {device.type} ({dtype}), recompute {args.recompute}"),
        ("step", f"{step:.3f} s"),
        ("tokens/s", f"{args.tokens / step:,.0f}"),
        ("model TFLOP/s", f"{model_flops(spec, lengths) / step / 1e12:.2f}"),
        (peak_name, f"{peak:.2f} GiB"),
    ]
    rows += [
        (f"time: {name}", f"{seconds:.3f} s ({seconds / step:.0%})")
        for name, seconds in parts.items()
    ]
    rows.append(("loss path peak extra memory", f"{ratio:.3f} x full fp32 logits"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--spec",
        choices=("te", "torch", "local"),
        default=None,
        help="model.spec (default: the machine's, models/gpt.py)",
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--layers", type=int, help="layers (default: the shape's)")
    parser.add_argument("--tokens", type=int, help="tokens per step (default: the shape's)")
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    parser.add_argument("--iterations", type=int, default=3, help="timed repeats of each part")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from megatron_fr.parallel.cpu_shims import install_cpu_shims

    install_cpu_shims()  # the learner runs in this process
    for name, value in run(args):
        if name == "loss path peak extra memory":
            print(f"loss path peak extra memory: {value}", flush=True)
        else:
            print(f"{name:38s} {value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
