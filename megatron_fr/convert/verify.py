"""Check a megatron checkpoint against its HF source: same tokens, compare the logits.

The HF model runs in this process (fp32); the megatron model runs on spawned gloo ranks in
the requested TP/EP/ETP/PP layout, loading the torch_dist checkpoint (megatron reshards it at
load) or, without one, the HF files directly (each rank reading its own slices, as a run
started from an HF directory does), then upcast to fp32. Pipeline stages hand their
activations on with plain send/recv.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.convert.shard import groups_or_megatron
from megatron_fr.models.hf_config import HFModelSpec, load_hf_config

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class VerifyJob:
    """One model, evaluated in one layout on the given tokens: loaded from the megatron
    checkpoint `megatron_dir`, or straight from the HF directory `hf_dir` when that is None."""

    megatron_dir: str | None
    config: dict
    parallel: ParallelConfig
    tokens: torch.Tensor
    hf_dir: str | None = None

    def hf_source(self) -> str:
        """hf_dir, which a job without megatron_dir loads from."""
        if self.hf_dir is None:
            raise ValueError("a verify job needs megatron_dir or hf_dir")
        return self.hf_dir


def verify_layout(
    spec: HFModelSpec,
    tensor: int = 1,
    expert: int = 1,
    expert_tensor: int | None = None,
    pipeline: int = 1,
) -> ParallelConfig:
    """The ParallelConfig for a verify run; ValueError (naming the setting) if it cannot fit.

    MoE with TP > 1 needs sequence parallelism (megatron requires it), so it is switched on.
    """
    from megatron_fr.models.layout import check_model_layout

    parallel = ParallelConfig(
        tensor=tensor,
        expert=expert,
        expert_tensor=expert_tensor,
        pipeline=pipeline,
        sequence_parallel=spec.is_moe and tensor > 1,
    )
    check_model_layout(spec, parallel)
    return parallel


def world_size_for(parallel: ParallelConfig) -> int:
    """The fewest ranks that hold one copy of the model in this layout."""
    return parallel.pipeline * math.lcm(
        parallel.tensor, parallel.expert * parallel.effective_expert_tensor
    )


def hf_logits(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def pipeline_logits(
    model: GPTModel,
    tokens: torch.Tensor,
    parallel: ParallelConfig,
    groups: ProcessGroupCollection | None = None,
) -> torch.Tensor | None:
    """Logits on the last stage (full vocab, [b, s, V]); None on the other stages. `groups`:
    the model's process groups (megatron's when not given)."""
    import torch.distributed as dist

    pp = groups_or_megatron(groups).pp
    stage, stages = pp.rank(), pp.size()
    batch, seq = tokens.shape
    positions = torch.arange(seq).expand_as(tokens)
    local_seq = seq // parallel.tensor if parallel.sequence_parallel else seq
    if stage > 0:
        hidden = torch.empty(local_seq, batch, model.config.hidden_size, dtype=torch.float32)
        dist.recv(hidden, src=dist.get_global_rank(pp, stage - 1))
        model.set_input_tensor(hidden)
    with torch.no_grad():
        output = model(tokens, positions, attention_mask=None, runtime_gather_output=True)
    if stage < stages - 1:
        dist.send(output.contiguous(), dst=dist.get_global_rank(pp, stage + 1))
        return None
    return output


def _source_dtype(job: VerifyJob) -> torch.dtype:
    from megatron_fr.convert.checkpoint import hf_dtype, megatron_dtype
    from megatron_fr.utils.hf_checkpoint import HFCheckpointReader

    if job.megatron_dir is not None:
        return megatron_dtype(Path(job.megatron_dir))
    with HFCheckpointReader(job.hf_source()) as reader:
        return hf_dtype(reader)


def megatron_logits_on_rank(rank: int, world_size: int, jobs: list[VerifyJob]) -> list:
    """Run every job on this rank; the last stage's logits (TP rank 0, DP rank 0) or None."""
    from megatron_fr.convert.checkpoint import load_megatron_checkpoint
    from megatron_fr.convert.parallel_load import load_hf_into_model
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.parallel import state

    results = []
    for job in jobs:
        state.initialize(job.parallel, seed=0)
        groups = state.process_groups()
        spec = load_hf_config(job.config)
        model = build_gpt_model(
            spec, job.parallel, params_dtype=_source_dtype(job), initialize=False
        )
        if job.megatron_dir is None:
            load_hf_into_model(model, job.hf_source(), spec, progress=False, groups=groups)
        else:
            load_megatron_checkpoint(model, job.megatron_dir)
        model = model.float().eval()
        logits = pipeline_logits(model, job.tokens, job.parallel, groups)
        keep = logits is not None and groups.tp.rank() == 0 and groups.dp.rank() == 0
        results.append(logits if keep else None)
    return results


def collect_logits(per_rank: list[list]) -> list[torch.Tensor]:
    """Job by job, the one logits tensor some rank returned."""
    by_job = zip(*per_rank, strict=True)
    return [next(logits for logits in job if logits is not None) for job in by_job]


def random_tokens(vocab_size: int, batch: int = 2, seq: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=generator)


def verify_checkpoint(
    hf_dir: str | Path,
    megatron_dir: str | Path | None,
    parallel: ParallelConfig,
    *,
    seq: int = 16,
    timeout_s: float = 1800.0,
) -> float:
    """max |megatron logit - HF logit| over a batch of random tokens, in the given layout;
    without `megatron_dir`, of the model loaded from the HF files directly."""
    from megatron_fr.parallel.spawn import run_on_ranks

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    spec = load_hf_config(config)
    if seq % parallel.tensor:
        seq += parallel.tensor - seq % parallel.tensor
    tokens = random_tokens(spec.vocab_size, seq=seq)
    source = None if megatron_dir is None else str(megatron_dir)
    job = VerifyJob(source, config, parallel, tokens, hf_dir=str(hf_dir))
    per_rank = run_on_ranks(
        megatron_logits_on_rank, world_size_for(parallel), [job], timeout_s=timeout_s
    )
    (logits,) = collect_logits(per_rank)
    return (logits - hf_logits(hf_dir, tokens)).abs().max().item()
