#!/usr/bin/env python
"""The Python steps of tools/gpu_check.sh (which runs them in order, tier by tier).

    python tools/gpu_check.py plan                 # the steps; imports every part (CPU is fine)
    python tools/gpu_check.py probe single|cluster|te # exit 0: the tier can run; 4: skipped
    python tools/gpu_check.py parity --out DIR     # tiny Qwen3-MoE, every layer spec vs HF
    python tools/gpu_check.py bench --out DIR      # torch vs local spec TFLOP/s; the slice
    python tools/gpu_check.py train --out DIR      # 3 steps of the loop, disk weight update
    python tools/gpu_check.py sglang --out DIR     # SGLang + NCCL weight update, GB/s/bucket

Every step prints its figures as `name: value` lines; a failed check exits 1 with the reason.
A probe that cannot run its tier prints `skipped: <why>` and exits 4; tools/gpu_check.sh
reports the tier SKIPPED with that reason, never as passed.

transformer-engine is not in requirements.txt (its torch extension is built from source
against the set's torch, and tools/check_gpu_requirements.py resolves wheels only), so the
cluster tier (SGLang + NCCL, what a cluster run does) does not need it: only the `te` tier,
the parity check with TE's layer spec, does.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIPPED, FAILED = 4, 1
PARTS = (
    "megatron_fr.models.gpt",
    "megatron_fr.models.torch_spec",
    "megatron_fr.convert.checkpoint",
    "megatron_fr.parallel.state",
    "megatron_fr.parallel.vocab_parallel",
    "megatron_fr.weights.sync",
    "megatron_fr.engine.launcher",
    "megatron_fr.engine.sglang.protocol",
    "megatron_fr.utils.gpu_telemetry",
    "megatron_fr.demo.tiny_models",
)
STEPS = {
    "single": [
        (
            "parity",
            "tiny Qwen3-MoE learner on CUDA in bf16, every layer spec this machine has "
            "(te with transformer-engine, torch, local): log-probs vs transformers on "
            "the same GPU, and a packed row of two sequences vs each alone",
        ),
        (
            "bench",
            "tools/bench_learner.py: the local and the torch spec on a 4-layer "
            "Qwen3-30B-A3B slice at 4,096 tokens (their TFLOP/s ratio), then the torch "
            "spec on the 8-layer slice at 16,384 packed tokens (128 experts, top-8): "
            "tokens/s, model TFLOP/s, peak memory, where the time goes, loss path memory; "
            "tools/bench_attention.py: the torch spec's CP attention at the flagship's CP2 "
            "shape, 48 layers forward and backward, the masks it builds",
        ),
        (
            "train",
            "3 steps of `megatron-fr train` (1 rank on this GPU, the CPU engine on the "
            "host, disk weight update in SGLang's loader layout)",
        ),
    ],
    "cluster": [
        (
            "sglang",
            "a real SGLang server on the tiny model (GPU 1; --skip-tokenizer-init: the "
            "checkpoint has no tokenizer, the step speaks token ids), NCCL weight update "
            "from the learner (GPU 0) in both bucket formats: engine log-probs vs "
            "learner's, GB/s per bucket",
        ),
    ],
    "te": [("parity", "the same parity check, now with transformer-engine's layer spec")],
}
NEEDS = {
    "single": "a CUDA device",
    "cluster": "2 CUDA devices and an SGLang that imports (transformer-engine not needed)",
    "te": "a CUDA device and transformer-engine",
}
"""What each tier's probe requires."""


def figure(name: str, value: object) -> None:
    print(f"{name}: {value}", flush=True)


def plan(_args: argparse.Namespace) -> int:
    """Print the tiers and import every module the steps use (works without a GPU)."""
    for tier, steps in STEPS.items():
        print(f"{tier} tier:")
        for name, what in steps:
            print(f"  {name:10s} {what}")
    for module in PARTS:
        importlib.import_module(module)
    figure("imports", f"{len(PARTS)} modules import")
    return 0


def probe(args: argparse.Namespace) -> int:
    """Exit 0 when `args.tier` can run here, else print why and exit SKIPPED."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    figure("gpus", ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) or "none")
    missing = [] if gpus else ["no CUDA device"]
    if args.tier == "te" and importlib.util.find_spec("transformer_engine") is None:
        missing.append(
            "transformer-engine not installed (built from source, not in requirements.txt)"
        )
    if args.tier == "cluster":
        if gpus < 2:
            missing.append(f"{gpus} GPU(s), the cluster tier needs 2")
        if importlib.util.find_spec("sglang") is None:
            missing.append("SGLang not installed")
        if not missing:
            try:
                importlib.import_module("sglang.srt.utils")
            except Exception as error:  # an SGLang that cannot run here
                missing.append(f"SGLang does not import ({type(error).__name__}: {error})")
    if missing:
        print(f"skipped: {'; '.join(missing)}")
        return SKIPPED
    return 0


# --- single-GPU tier ---------------------------------------------------------------------------


def tiny_checkpoint(directory: Path, seed: int) -> Path:
    """A random tiny Qwen3-MoE (the CPU demo's shape) saved by transformers."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_fr.demo.tiny_models import tiny_model_config

    if not (directory / "config.json").exists():
        torch.manual_seed(seed)
        config = AutoConfig.for_model(**tiny_model_config(vocab_size=16))
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


def megatron_learner(hf_dir: Path, megatron_dir: Path, spec_kind: str | None = None):
    """(spec, bf16 megatron model of layer spec `spec_kind` on this GPU) holding hf_dir's
    weights; one rank."""
    import torch

    from megatron_fr.config.parallel import ParallelConfig
    from megatron_fr.convert.checkpoint import hf_to_megatron_checkpoint, load_megatron_checkpoint
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel.state import initialize_single_process

    initialize_single_process(ParallelConfig(), seed=0)
    if not megatron_dir.exists():
        hf_to_megatron_checkpoint(hf_dir, megatron_dir, progress=False)
    spec = load_hf_config(hf_dir)
    model = build_gpt_model(
        spec, ParallelConfig(), params_dtype=torch.bfloat16, initialize=False, spec_kind=spec_kind
    )
    load_megatron_checkpoint(model, megatron_dir)
    return spec, model.eval()


def learner_log_probs(model, tokens, prompt_len: int, packed_seq_params=None, positions=None):
    """Log-probs of tokens[prompt_len:] by the megatron model (inputs on its device)."""
    import torch

    ids = torch.tensor([tokens], device="cuda")
    if positions is None:
        positions = torch.arange(len(tokens), device="cuda").unsqueeze(0)
    with torch.no_grad():
        logits = model(
            ids,
            positions,
            attention_mask=None,
            runtime_gather_output=True,
            packed_seq_params=packed_seq_params,
        )
    log_probs = torch.log_softmax(logits[0].float(), dim=-1)
    targets = torch.tensor(tokens[prompt_len:], device="cuda")
    return log_probs[prompt_len - 1 : -1].gather(-1, targets[:, None])[:, 0]


def packed_row_difference(model, first: list[int], second: list[int]) -> float:
    """Max |log-prob| difference between two sequences packed in one row (THD) and each
    alone: the spec's packed-row attention (varlen or masked SDPA, TE's, the local one)."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    n, m = len(first), len(second)
    cu = torch.tensor([0, n, n + m], dtype=torch.int32, device="cuda")
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(n, m),
        max_seqlen_kv=max(n, m),
    )
    positions = torch.cat([torch.arange(n), torch.arange(m)]).to("cuda")[None]
    together = learner_log_probs(model, first + second, 1, params, positions)
    alone = torch.cat([learner_log_probs(model, first, 1), learner_log_probs(model, second, 1)])
    keep = torch.ones_like(together, dtype=torch.bool)
    keep[n - 1] = False  # the first sequence's last token would predict the second's first
    return (together[keep] - alone).abs().max().item()


def parity(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_fr.models.gpt import use_transformer_engine

    hf_dir = tiny_checkpoint(args.out / "tiny_hf", seed=0)
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, reference.config.vocab_size, (48,), generator=generator).tolist()
    with torch.no_grad():
        logits = reference(torch.tensor([tokens], device="cuda")).logits
    theirs = torch.log_softmax(logits[0].float(), -1)[:-1].gather(
        -1, torch.tensor(tokens[1:], device="cuda")[:, None]
    )[:, 0]
    worst = 0.0
    for kind in ("te", "torch", "local") if use_transformer_engine() else ("torch", "local"):
        _, model = megatron_learner(hf_dir, args.out / f"tiny_megatron_{os.getpid()}", kind)
        diff = (learner_log_probs(model, tokens, 1) - theirs).abs().max().item()
        packed = packed_row_difference(model, tokens[:20], tokens[20:])
        figure(f"max |log-prob {kind} spec - transformers| (bf16, 47 tokens)", f"{diff:.4f}")
        figure(f"max |log-prob packed row - alone| ({kind} spec)", f"{packed:.4f}")
        worst = max(worst, diff, packed)
    if worst > args.tolerance:
        print(f"FAILED: log-probs differ by {worst:.4f} > {args.tolerance}")
        return FAILED
    return 0


SMALL = ["--layers", "4", "--tokens", "4096"]
BENCH_RUNS = (  # (label, tools/bench_learner.py arguments)
    ("local spec, 4 layers, 4,096 tokens", ["--spec", "local", *SMALL]),
    ("torch spec, 4 layers, 4,096 tokens", ["--spec", "torch", *SMALL]),
    ("torch spec, 8 layers, 16,384 tokens", ["--spec", "torch"]),
)


def bench(args: argparse.Namespace) -> int:
    """tools/bench_learner.py on the Qwen3-30B-A3B slice, a fresh process per run, then
    tools/bench_attention.py at its defaults."""
    tflops = {}
    for label, extra in BENCH_RUNS:
        bench_learner = str(REPO / "tools" / "bench_learner.py")
        command = [sys.executable, bench_learner, "--shape", "slice", *extra]
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        print(f"  [{label}]")
        for line in result.stdout.splitlines():
            print(f"    {line}", flush=True)
            if line.startswith("model TFLOP/s"):
                tflops[label] = float(line.split()[-1])
        if result.returncode:
            print(f"FAILED: {label}: exit {result.returncode}\n{result.stderr[-3000:]}")
            return FAILED
    local, mine, slice_ = (tflops[label] for label, _ in BENCH_RUNS)
    figure(
        "model TFLOP/s torch / local spec (4 layers, 4,096 tokens)",
        f"{mine:.1f} / {local:.1f} = {mine / local:.1f} x",
    )
    figure("model TFLOP/s torch spec (8 layers, 16,384 tokens)", f"{slice_:.1f}")
    command = [sys.executable, str(REPO / "tools" / "bench_attention.py"), "--attention"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    print("  [torch spec CP attention, the flagship's CP2 shape]")
    for line in result.stdout.splitlines():
        print(f"    {line}", flush=True)
    if result.returncode:
        print(f"FAILED: bench_attention: exit {result.returncode}\n{result.stderr[-3000:]}")
        return FAILED
    return 0


def train(args: argparse.Namespace) -> int:
    """demo prepare (warm start) -> the CPU engine on the host -> 3 steps on this GPU."""
    from megatron_fr.utils.net import free_port

    run_dir, recipe = args.out / "train_run", str(REPO / "examples" / "cpu_demo.yaml")
    hf_dir = str(args.out / "demo_model")
    quick = [
        f"model.hf_dir={hf_dir}",
        "learner_ranks=1",
        "parallel.expert=1",
        "eval.every_steps=0",
        "buffer.batch_size=16",
        "buffer.capacity=64",
        "buffer.max_in_flight=32",
        "learner.params_dtype=bfloat16",
    ]
    command = [sys.executable, "-m", "megatron_fr"]
    prepare = [*command, "demo", "prepare", recipe, f"model.hf_dir={hf_dir}"]
    warm_start = ["demo.warm_start.steps=60", "demo.warm_start.batch_size=32"]
    subprocess.run([*prepare, *warm_start], capture_output=True, text=True, check=True)
    port = free_port()
    with open(args.out / "cpu_engine.log", "w") as log:
        serve = [sys.executable, "-m", "megatron_fr.engine.cpu.server", "--model-path", hf_dir]
        serve += ["--port", str(port), "--threads", "4"]
        engine = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        urls = json.dumps([f"http://127.0.0.1:{port}"])
        run = [*command, "train", recipe, "--run-dir", str(run_dir), *quick, "steps=3"]
        run += [f"rollout.engine.urls={urls}", "weights.transport=disk"]
        run += [f"weights.directory={args.out / 'weights'}", "weights.spot_check=0"]
        result = subprocess.run(run, capture_output=True, text=True, timeout=600)
    finally:
        engine.kill()
        engine.wait()
    if result.returncode:
        print(f"FAILED: megatron-fr train exited {result.returncode}:\n{result.stderr[-3000:]}")
        return FAILED
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward_mean" in row]
    figure("steps logged", [row["step"] for row in steps])
    figure("wall time (3 steps, incl. start)", f"{time.monotonic() - started:.0f} s")
    for key in ("step_s", "sync_s", "tokens_per_s"):
        figure(f"{key} (last step)", f"{steps[-1][key]:.3g}")
    return 0 if [row["step"] for row in steps] == [1, 2, 3] else FAILED


# --- cluster tier ------------------------------------------------------------------------------


def sglang(args: argparse.Namespace) -> int:
    """SGLang serves the tiny model (seed 0) on GPU 1; the learner (seed 1) on GPU 0 sends its
    weights over NCCL; after, SGLang's log-probs must be the learner's."""
    import torch

    from megatron_fr.config.weights import WeightSyncConfig
    from megatron_fr.engine.http import post_json
    from megatron_fr.engine.launcher import ServerLaunchConfig, launch_server
    from megatron_fr.weights.sync import WeightSync
    from megatron_fr.weights.transports import Engine

    served = tiny_checkpoint(args.out / "tiny_hf", seed=0)
    learner_hf = tiny_checkpoint(args.out / "tiny_hf_learner", seed=1)
    launch = ServerLaunchConfig(
        model_path=str(served),
        port=args.port,
        engine="sglang",
        gpu_ids=(1,),
        mem_fraction_static=0.5,
        skip_tokenizer_init=True,  # tiny_checkpoint saves no tokenizer; ids in, ids out
        log_dir=args.out,
    )
    server = launch_server(launch)
    try:
        server.wait_healthy(deadline_s=600)
        spec, model = megatron_learner(learner_hf, args.out / f"learner_megatron_{os.getpid()}")
        prompt = [3, 17, 42, 5]

        def max_diff() -> float:
            sampling = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}
            body = {
                "input_ids": prompt,
                "return_logprob": True,
                "logprob_start_len": -1,
                "sampling_params": sampling,
            }
            answer = post_json(server.url, "/generate", body, 120)
            engine = torch.tensor([e[0] for e in answer["meta_info"]["output_token_logprobs"]])
            mine = learner_log_probs(model, prompt + answer["output_ids"], len(prompt)).cpu()
            return (mine - engine).abs().max().item()

        figure("max |engine - learner| log-prob before", f"{max_diff():.4f}")
        after = 0.0
        for version, bucket_format in enumerate(("tensors", "flattened"), start=1):
            config = WeightSyncConfig(
                master_address="127.0.0.1",
                master_port=args.port + 50 + 10 * version,
                backend="nccl",
                bucket_mib=args.bucket_mib,
                bucket_format=bucket_format,
                timeout_s=300,
            )
            sync = WeightSync.from_config(config, [Engine(server.url)], spec)
            sync.connect()
            timings = _time_buckets(sync)
            report = sync.sync(model, version=version)
            sync.close()
            diff = max_diff()
            after = max(after, diff)
            figure("engines", sync.engines)
            figure(
                f"sync ({bucket_format})",
                f"{report.bytes / 1e6:.1f} MB in {report.buckets} buckets, {report.seconds:.2f} s",
            )
            for index, (nbytes, seconds) in enumerate(timings):
                figure(
                    f"  bucket {index} GB/s",
                    f"{nbytes / seconds / 1e9:.2f} ({nbytes / 1e6:.1f} MB)",
                )
            figure(f"max |engine - learner| log-prob after ({bucket_format})", f"{diff:.4f}")
    finally:
        server.stop()
    if after > args.tolerance:
        print(f"FAILED: after the update the engine's log-probs differ by {after:.4f}")
        return FAILED
    return 0


def _time_buckets(sync) -> list[tuple[int, float]]:
    """Wrap the transport's send to time each bucket; the list fills during the sync."""
    import torch

    timings: list[tuple[int, float]] = []
    send = sync.transport.send

    def timed(bucket):
        torch.cuda.synchronize()
        started = time.perf_counter()
        send(bucket)
        torch.cuda.synchronize()
        timings.append(
            (sum(t.numel() * t.element_size() for _, t in bucket), time.perf_counter() - started)
        )

    sync.transport.send = timed
    return timings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("plan", help="print the steps; import every part").set_defaults(run=plan)
    probe_parser = sub.add_parser("probe", help="can this tier run here?")
    probe_parser.add_argument("tier", choices=sorted(STEPS))
    probe_parser.set_defaults(run=probe)
    for name, run in (("parity", parity), ("bench", bench), ("train", train), ("sglang", sglang)):
        step = sub.add_parser(name, help=dict(STEPS["single"] + STEPS["cluster"])[name])
        step.add_argument("--out", type=Path, required=True, help="work directory")
        step.add_argument(
            "--tolerance",
            type=float,
            default=0.05,
            help="largest |log-prob difference| accepted (bf16)",
        )
        step.add_argument("--port", type=int, default=31000, help="sglang: server port")
        step.add_argument("--bucket-mib", type=int, default=1, help="sglang: bucket size")
        step.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_fr.parallel.cpu_shims import install_cpu_shims

    install_cpu_shims()  # the steps run megatron in this process (`plan` too, on a CPU)
    if getattr(args, "out", None) is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
