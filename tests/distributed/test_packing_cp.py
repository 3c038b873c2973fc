"""Packing and context parallelism change the layout of a learner step, not the step.

One spawn of 2 gloo ranks runs, for a MoE model (tiny Qwen3-MoE) and a dense one (tiny Qwen2:
tied embeddings, QKV biases), the same batch through the real Learner in four layouts: one
trajectory per row or several packed per row, at DP2 x CP1 and DP1 x CP2. All four must give
the same loss, acceptance, sequence KL, grad norm, learner log-probs and updated weights.
The optimizer is set so that updated weights compare gradients: with lr = adam_eps = 1 and no
clipping, Adam's first update of a parameter is g / (|g| + 1), one-to-one with its gradient g.
The padded DP2 layout is megatron's plain causal path (what tests/distributed/test_learner.py
checks against transformers); packed rows go through megatron's THD path (PackedSeqParams,
THD RoPE); CP2 through megatron's zigzag split of rows and RoPE tables, and on CPU through
the local spec's extension of its attention to TE's CP algorithm (models/attention.py). The
CP split of padded rows is also checked against megatron's own get_batch_on_this_cp_rank.

    .venv/bin/python -m pytest tests/distributed/test_packing_cp.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_qwen import tiny_checkpoint

from megatron_fr.buffer.trajectory import Trajectory
from megatron_fr.config import FlashReinforceConfig, LearnerConfig
from megatron_fr.parallel.spawn import run_on_ranks

MODELS = {  # model type -> negative-token fraction q (q < 1 gathers whole trajectories over CP)
    "qwen3_moe": 1.0,
    "qwen2": 0.5,
}
LAYOUTS = [  # (name, ParallelConfig kwargs, pack sequences)
    ("padded DP2", dict(), False),
    ("packed DP2", dict(), True),
    ("packed CP2", dict(context=2), True),
    ("padded CP2", dict(context=2), False),
]
BUDGET, DELTA, TOLERANCE = 48, 2e-3, 1e-5


def long_tailed_batch(size: int = 10, seed: int = 0) -> list[Trajectory]:
    """Mostly short trajectories and a few long ones, rewards 0 / 1, near-on-policy mu."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(2.3 + 0.6 * torch.randn(size, generator=generator)).clamp(4, 30).long()
    batch = []
    for index, length in enumerate(lengths.tolist()):
        prompt = int(torch.randint(1, min(5, length - 1), (1,), generator=generator))
        response = length - prompt
        tokens = torch.randint(0, 128, (length,), generator=generator).tolist()
        noise = 0.3 * torch.randn(response, generator=generator)
        behavior = [0.0] * prompt + (-4.8 + noise).clamp(max=-0.01).tolist()
        reward = float(torch.rand(1, generator=generator) < 0.5)
        mask = [False] * prompt + [True] * response
        versions = [-1] * prompt + [0] * response
        batch.append(Trajectory(f"p{index}", tokens, mask, behavior, versions, reward))
    return batch


def convert(rank: int, world_size: int, pairs: list[tuple[str, str]]) -> None:
    from megatron_fr.convert.checkpoint import hf_to_megatron_checkpoint

    for hf_dir, out in pairs:
        hf_to_megatron_checkpoint(hf_dir, out, progress=False)


def check_cp_split_is_megatrons(batch: list[Trajectory]) -> None:
    """Padded rows split by micro_batches_for_rank == megatron's get_batch_on_this_cp_rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_fr.learner.micro_batches import micro_batches_for_rank, plan_micro_batches

    plan = plan_micro_batches(
        [t.length for t in batch], dp_size=1, micro_batch_tokens=BUDGET // 2, pack=False, cp_size=2
    )
    whole = micro_batches_for_rank(batch, dataclasses.replace(plan, cp_size=1), dp_rank=0)
    mine = micro_batches_for_rank(batch, plan, dp_rank=0, cp_rank=ps.get_context_parallel_rank())
    for full, split in zip(whole, mine, strict=True):
        theirs = get_batch_on_this_cp_rank(
            {
                "tokens": full.input_ids.clone(),
                "labels": full.loss_batch.target_ids.clone(),
                "position_ids": full.positions.clone(),
                "cu_seqlens": None,
            },
            is_hybrid_cp=False,
            cp_group=ps.get_context_parallel_group(),
        )
        assert torch.equal(theirs["tokens"], split.input_ids)
        assert torch.equal(theirs["labels"], split.loss_batch.target_ids)
        assert torch.equal(theirs["position_ids"], split.positions)


def learner_runs(rank: int, world_size: int, checkpoints: dict[str, str], batch):
    from megatron_fr.config import ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    results = {}
    for model_type, fraction in MODELS.items():
        spec = load_hf_config(checkpoints[model_type + ".config"])
        for name, kwargs, pack in LAYOUTS:
            parallel = ParallelConfig(**kwargs)
            state.initialize(parallel, seed=0)
            if parallel.context == 2 and not pack:
                check_cp_split_is_megatrons(batch)
            config = LearnerConfig(
                params_dtype="float32",
                micro_batch_tokens=BUDGET // parallel.context,
                lr=1.0,
                adam_eps=1.0,
                clip_grad=0.0,
                pack_sequences=pack,
                flash_reinforce=FlashReinforceConfig(delta=DELTA, negative_token_fraction=fraction),
            )
            learner = Learner(
                spec, parallel, config, total_steps=1, init_checkpoint=checkpoints[model_type]
            )
            log_probs = learner.policy_log_probs(batch)
            metrics = learner.train_step(batch)
            weights = {
                k: v.detach().clone()
                for k, v in learner.module.state_dict().items()
                if isinstance(v, torch.Tensor)
            }
            results[model_type, name] = (metrics, log_probs, weights)
    return results


@pytest.mark.distributed
def test_packed_and_context_parallel_steps_equal_the_padded_step(tmp_path):
    checkpoints, pairs = {}, []
    for seed, model_type in enumerate(MODELS):
        config, *_ = tiny_checkpoint(model_type, tmp_path / model_type, seed=seed)
        checkpoints[model_type] = str(tmp_path / f"{model_type}.megatron")
        checkpoints[model_type + ".config"] = config
        pairs.append((str(tmp_path / model_type), checkpoints[model_type]))
    run_on_ranks(convert, 1, pairs)
    batch = long_tailed_batch()
    per_rank = run_on_ranks(learner_runs, 2, checkpoints, batch, timeout_s=900)

    for model_type in MODELS:
        reference_metrics, reference_log_probs, reference_weights = per_rank[0][
            model_type, LAYOUTS[0][0]
        ]
        assert 0 < reference_metrics["acceptance_rate"] < 1, "the gate should split this batch"
        for name, *_ in LAYOUTS:
            where = f"{model_type} {name}"
            metrics, log_probs, weights = per_rank[0][model_type, name]
            assert per_rank[1][model_type, name][0] == metrics, f"{where}: ranks disagree"
            for key in ("loss", "acceptance_rate", "sequence_kl_mean"):
                assert metrics[key] == pytest.approx(reference_metrics[key], abs=TOLERANCE), (
                    f"{where}: {key}"
                )
            assert metrics["grad_norm"] == pytest.approx(
                reference_metrics["grad_norm"], rel=TOLERANCE
            ), where
            # each trajectory's gradient-carrying tokens, summed over its CP slices
            assert metrics["retained_tokens"] == reference_metrics["retained_tokens"], where
            for ours, theirs in zip(log_probs, reference_log_probs, strict=True):
                assert len(ours) == len(theirs)
                assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=TOLERANCE)
            assert weights.keys() == reference_weights.keys()
            for key, value in weights.items():
                difference = (value - reference_weights[key]).abs().max().item()
                assert difference <= TOLERANCE, f"{where}: {key} differs by {difference}"
        padding = {
            name: per_rank[0][model_type, name][0]["padding_fraction"] for name, *_ in LAYOUTS
        }
        assert padding["packed DP2"] < padding["padded DP2"], padding
        assert padding["packed CP2"] < padding["padded CP2"], padding
