"""`megatron-fr rehearse RECIPE` (also `train RECIPE --rehearse`): the recipe's learner step
rehearsed on this machine (launch/rehearsal.py), per rank, beside the planner's figures
(launch/plan.py), and a verdict against the GPU's memory less the planner's reserve. Exit
status 0 when every rehearsed rank fits, 3 when one does not (tools/plan_layout.py's status
for a layout too big).

The model: model.hf_dir's config.json when the directory is there (its safetensors' tensor
names and shapes checked against each rank's shards, from the headers alone, unless --layers
cuts the model), else the planner's known model of the directory's name (models/presets:
`/models/Qwen3-30B-A3B` is qwen3-30b-a3b), so it runs with no model files. --layers N
rehearses (and plans) the model cut to its first N layers: every decoder layer has the same
shapes, so a short rehearsal measures the per-layer terms of the whole model.

The world: the recipe's cluster.learner_nodes x learner_ranks (config/cluster.py), or
--world-size. What fake tensors cannot trace is added to both columns as the planner's stated
terms (launch/plan.py: untraced_terms, each printed with its source): the CUDA context and
cuBLAS workspaces, NCCL buffers per group; and the weight sync's buckets on the sending rank
(every rehearsed rank is its stage's first, the sender), which are alive after the optimizer
step, so they are a peak candidate beside the step's (model state + buckets), not added on top.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_fr.config.run import RunConfig
    from megatron_fr.launch.plan import Plan, StagePlan
    from megatron_fr.launch.rehearsal import Memory
    from megatron_fr.models.hf_config import HFModelSpec

GIB = 2**30
TOO_BIG = 3
DEFAULT_GPU_MEM_GIB = 80.0
"""An H100's memory, the verdict's default when --gpu-mem-gb is not given."""


REHEARSE_HELP = (
    "rehearse one learner step at the recipe's real shapes under fake tensors on this "
    "machine (no GPU), print its memory per part beside the planner's; start nothing"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The rehearsal's options of `megatron-fr train` (--world-size and --gpu-mem-gb are
    shared with --check): --rehearse, and the flags only it reads."""
    parser.add_argument("--rehearse", action="store_true", help=REHEARSE_HELP)
    add_rehearsal_flags(parser)


def add_rehearsal_flags(parser: argparse.ArgumentParser) -> None:
    """The flags only a rehearsal reads (`megatron-fr rehearse`, `train --rehearse`)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--rank", type=int, help="--rehearse: this rank only")
    which.add_argument(
        "--stages",
        action="store_true",
        help="--rehearse: the first rank of every pipeline stage (the default)",
    )
    parser.add_argument(
        "--skew",
        type=float,
        default=0.0,
        help="--rehearse: this rank's experts receive (1 + skew) x the balanced token count",
    )
    parser.add_argument(
        "--cpu-kernels",
        action="store_true",
        help="--rehearse: the CPU kernels' memory where a GPU's differs (norms, Adam)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=0,
        help="--rehearse: the model cut to its first N layers (default: all)",
    )


def run(config: RunConfig, world: int, args: argparse.Namespace) -> int:
    """Rehearse the ranks asked for and print the table and the verdict of each."""
    from megatron_fr.launch.plan import DEFAULT_RESERVE_GIB
    from megatron_fr.launch.rehearsal import rehearse
    from megatron_fr.launch.rehearse_args import check_world

    check_world(config, world, args)  # before the model is read or a rank is built
    spec, source = model_spec(config, args.layers)
    weights = Path(config.model.hf_dir)
    # its tensors are checked against each rank's shards unless the model is cut
    hf_dir = str(weights) if any(weights.glob("*.safetensors")) and not args.layers else None
    plan = planned(config, spec, world, args.gpu_mem_gb or DEFAULT_GPU_MEM_GIB)
    pp = config.parallel.pipeline
    ranks = [args.rank] if args.rank is not None else [s * world // pp for s in range(pp)]
    if any(not 0 <= rank < world for rank in ranks):
        raise ValueError(f"--rank {args.rank}: the world has ranks 0 to {world - 1}")
    cluster = config.cluster
    origin = (
        "--world-size"
        if args.world_size
        else f"cluster.learner_nodes {cluster.learner_nodes} x learner_ranks {config.learner_ranks}"
    )
    print(f"model {source}: {spec.num_layers} layers; {world} ranks ({origin}); reserve "
          f"{DEFAULT_RESERVE_GIB:g} GiB", flush=True)  # fmt: skip
    fits = True
    for rank in ranks:
        memory = rehearse(
            config,
            spec,
            world=world,
            rank=rank,
            skew=args.skew,
            cpu_kernels=args.cpu_kernels,
            hf_dir=hf_dir,
            progress=_bar,
        )
        print(file=sys.stderr)
        print(table(config, plan, rank, memory), flush=True)
        fits &= total_peak(plan, memory) + plan.reserve_bytes <= (plan.gpu_mem_bytes or 0)
    return 0 if fits else TOO_BIG


def model_spec(config: RunConfig, layers: int = 0) -> tuple[HFModelSpec, str]:
    """The recipe's model (module docstring) and where it came from, cut to `layers`."""
    import json

    from megatron_fr.models.hf_config import load_hf_config, preset_names, spec_from_dict

    hf_dir = Path(config.model.hf_dir)
    if (hf_dir / "config.json").is_file():
        spec = spec_from_dict(json.loads((hf_dir / "config.json").read_text()))
        source = str(hf_dir)
    elif hf_dir.name.lower() in preset_names():
        spec, source = load_hf_config(hf_dir.name.lower()), f"{hf_dir.name.lower()} (preset)"
    else:
        raise ValueError(
            f"model.hf_dir {hf_dir}: no config.json there, and {hf_dir.name.lower()!r} is not "
            f"a known model ({', '.join(preset_names())})"
        )
    if layers:
        if not 0 < layers <= spec.num_layers:
            raise ValueError(f"--layers {layers}: the model has 1 to {spec.num_layers}")
        spec = dataclasses.replace(spec, num_layers=layers)
    return spec, source


def planned(config: RunConfig, spec: HFModelSpec, world: int, gpu_mem_gib: float) -> Plan:
    """The planner's figures for the recipe's layout and this model."""
    from megatron_fr.launch.plan import plan_layout

    learner = config.learner
    return plan_layout(
        spec,
        config.parallel,
        world,
        micro_batch_tokens=learner.micro_batch_tokens,
        params_dtype=learner.params_dtype,
        gpu_mem_gib=gpu_mem_gib,
        entropies=learner.flash_reinforce.negative_token_fraction < 1,
        sync_bucket_bytes=config.weights.bucket_mib * 2**20,
        sync_overlap=config.weights.overlap,
    )


def total_peak(plan: Plan, memory: Memory) -> int:
    """The rehearsed peak with what it cannot trace: the larger of the step's peak and the
    model state with the weight sync's buckets, plus the stated terms (module docstring)."""
    state = memory.weights + memory.grads + memory.optimizer
    sync = plan.stages[memory.stage].sync_bytes
    return max(memory.peak, state + sync) + plan.untraced_bytes


def table(config: RunConfig, plan: Plan, rank: int, memory: Memory) -> str:
    """The per-part table, the rehearsal-vs-planner line and the verdict of one rank."""
    mode = config.learner.recompute
    stage: StagePlan = plan.stages[memory.stage]
    planned_peak = stage.state_bytes + stage.activation_bytes[mode] + plan.untraced_bytes
    peak = total_peak(plan, memory)
    rows = [
        ("weights", memory.weights, stage.weight_bytes),
        ("gradients (fp32 buffers)", memory.grads, stage.grad_bytes),
        ("optimizer (main + Adam)", memory.optimizer, stage.optimizer_bytes),
        ("kept activations", memory.activations, stage.kept_bytes[mode]),
        ("temporaries", memory.temporaries, stage.activation_bytes[mode] - stage.kept_bytes[mode]),
        ("traced peak", memory.peak, stage.state_bytes + stage.activation_bytes[mode]),
        ("sync buckets (after step)", stage.sync_bytes, stage.sync_bytes),
        *((term.name, term.bytes, term.bytes) for term in plan.untraced),
        ("peak", peak, planned_peak),
    ]
    lines = [
        f"rank {rank} (stage {memory.stage}), learner.recompute {mode}, {memory.seconds:.0f} s",
        f"  {'part':<34}{'rehearsal':>12}{'planner':>12}",
        *(f"  {name:<34}{_gib(ours):>12}{_gib(theirs):>12}" for name, ours, theirs in rows),
        *(f"  stated: {term.name}: {term.source}" for term in plan.untraced),
        f"rehearsal peak {peak / GIB:.2f} GiB, planner {planned_peak / GIB:.2f} GiB",
    ]
    budget = (plan.gpu_mem_bytes or 0) - plan.reserve_bytes
    margin = budget - peak
    share = margin / (plan.gpu_mem_bytes or 1)
    verdict = "fits" if margin >= 0 else "does NOT fit"
    lines.append(
        f"verdict: {verdict} {(plan.gpu_mem_bytes or 0) / GIB:g} GiB less the "
        f"{plan.reserve_bytes / GIB:g} GiB reserve: margin {margin / GIB:.2f} GiB "
        f"({share:.0%} of the GPU)"
    )
    return "\n".join(lines)


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"


def _bar(line: str) -> None:
    """The progress line, rewritten in place on a terminal."""
    print(f"\r  {line:<40}", end="", file=sys.stderr, flush=True)
