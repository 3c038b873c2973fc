"""The torch spec's attention for packed rows and context parallelism
(models/chunked_attention.py: one causal SDPA per zigzag chunk, no row mask) computes plain
causal attention within each sequence.

In one process, every rank of CP 1 to 4 (the gather stood in for by indexing), with the
shared tile and with the bias CUDA's kernels take. One spawn of 2 gloo ranks:
  - the attention at CP2 (keys and values gathered over the real CP group) against causal
    attention per sequence written out below (float64 matmul, softmax, matmul on the whole
    row, no CP): outputs and the gradients of queries, keys and values agree to 1e-10 for
    rows of several sequences, one sequence, and two rows at once; three layers on one
    micro-batch build one mask tile between them (this CPU has no fused lower-right kernel)
    and no tensor of the [local queries x gathered keys] shape of a row mask is ever made;
  - a tiny Qwen3-MoE (GQA) on the torch spec through the real Learner in float32: one
    trajectory per row at DP2 (plain causal SDPA: no chunks, no CP, no packing) is the
    reference for packed rows at DP2, packed rows at CP2 and padded rows at CP2: loss, grad
    norm, log-probs and updated weights agree to 1e-5 (lr = adam_eps = 1, no clipping: Adam's
    first update of a parameter is g / (|g| + 1), one-to-one with its gradient g).

    .venv/bin/python -m pytest tests/distributed/test_cp_attention.py -q
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_packing_cp import long_tailed_batch

from megatron_fr.parallel.spawn import run_on_ranks

ROWS = [  # (sequence boundaries of a row before the CP split, rows at once)
    ([0, 8, 32, 36, 48], 1),
    ([0, 64], 1),
    ([0, 12, 40], 2),
]
HEADS, GROUPS, DIM, SCALE, LAYERS = 4, 2, 8, 0.3, 3
LAYOUTS = [  # (name, ParallelConfig kwargs, pack sequences); the first is the reference
    ("padded DP2", dict(), False),
    ("packed DP2", dict(), True),
    ("packed CP2", dict(context=2), True),
    ("padded CP2", dict(context=2), False),
]
BUDGET, TOLERANCE = 48, 1e-5


def causal_per_sequence(query, key, value, boundaries):
    """[tokens, b, heads, d] queries; keys and values [tokens, b, groups, d]: each token
    attends to its own sequence's tokens up to itself."""
    repeat = query.shape[2] // key.shape[2]
    key, value = (x.repeat_interleave(repeat, dim=2) for x in (key, value))
    outputs = []
    for start, end in itertools.pairwise(boundaries):
        q, k, v = (x[start:end].permute(1, 2, 0, 3) for x in (query, key, value))
        scores = SCALE * q @ k.transpose(-1, -2)
        later = torch.ones(end - start, end - start, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(later, float("-inf")).softmax(-1)
        outputs.append((weights @ v).permute(2, 0, 1, 3))
    return torch.cat(outputs)


def random_row(tokens: int, rows: int, seed: int) -> list[torch.Tensor]:
    """Queries, keys, values and an upstream gradient for `rows` rows of `tokens` tokens."""
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(tokens, rows, heads, DIM, generator=generator, dtype=torch.float64)
        for heads in (HEADS, GROUPS, GROUPS, HEADS)
    ]


@pytest.mark.parametrize("fused", [False, True])
def test_every_rank_of_cp1_to_cp4_in_one_process(monkeypatch, fused):
    """CP 1 to 4 on packed rows, every rank in this process (the all-gather stood in for by
    indexing with the ranks' zigzag positions, so the gradients flow back the same way), all
    ranks' outputs and gradients against causal attention per sequence. fused: the branch a
    CUDA kernel takes (torch's lower-right CausalBias, which this CPU torch expands itself)
    in place of the shared tile; no tile is then built."""
    from megatron_fr.models import chunked_attention
    from megatron_fr.parallel.context_parallel import zigzag_indices

    if fused:
        monkeypatch.setattr(chunked_attention, "can_use_flash_attention", lambda params: True)
    built = chunked_attention.MASKS.built
    for cp, boundaries in {
        1: [0, 5, 12],
        2: [0, 8, 32, 36, 48],
        3: [0, 12, 36, 48],
        4: [0, 16, 48, 64],
    }.items():
        leaves = [x.requires_grad_() for x in random_row(boundaries[-1], 1, seed=cp)]
        query, key, value, upstream = leaves
        expected = causal_per_sequence(query, key, value, boundaries)
        wanted = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
        gathered = torch.cat([zigzag_indices(boundaries, cp, rank) for rank in range(cp)])
        total = 0
        for rank in range(cp):
            local = zigzag_indices(boundaries, cp, rank)
            layout = chunked_attention.chunk_layout(tuple(boundaries), cp, rank)
            output = chunked_attention.chunked_causal_attention(
                query[local], key[gathered], value[gathered], layout, SCALE
            )
            assert (output - expected[local]).abs().max() <= 1e-10, (cp, rank)
            total = total + (output * upstream[local]).sum()
        found = torch.autograd.grad(total, (query, key, value))
        for ours, theirs in zip(found, wanted, strict=True):
            assert (ours - theirs).abs().max() <= 1e-10, cp
    assert (chunked_attention.MASKS.built == built) == fused


def attention_at_cp2(rank: int) -> list[dict]:
    """Per row layout: this rank's outputs and gradients against the reference's share, the
    mask tiles built by three layers, and the largest trailing 2-D shape any op produced."""
    from megatron.core import parallel_state as ps
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_fr.models.attention import gather_keys_and_values
    from megatron_fr.models.chunked_attention import (
        MASKS,
        chunk_layout,
        chunked_causal_attention,
    )
    from megatron_fr.parallel.context_parallel import zigzag_indices

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, tuple | list) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2:
                    self.seen.add(tuple(tensor.shape[-2:]))
            return out

    group = ps.get_context_parallel_group()
    results = []
    for boundaries, rows in ROWS:
        tokens = boundaries[-1]
        query, key, value, upstream = random_row(tokens, rows, seed=len(boundaries) * 100 + rows)
        leaves = [x.clone().requires_grad_() for x in (query, key, value)]
        causal_per_sequence(*leaves, boundaries).backward(upstream)
        local = zigzag_indices(boundaries, 2, rank)
        mine = [x[local].clone().requires_grad_() for x in (query, key, value)]
        built, host = MASKS.built, MASKS.host_bytes
        shapes = Shapes()
        with shapes:
            for _ in range(LAYERS):  # every layer of one micro-batch
                layout = chunk_layout(tuple(boundaries), 2, rank)
                gathered = gather_keys_and_values(mine[1], mine[2], group)
                output = chunked_causal_attention(mine[0], *gathered, layout, SCALE)
                output.backward(upstream[local])
        expected = causal_per_sequence(query, key, value, boundaries)[local]
        results.append(
            dict(
                output=(output.detach() - expected).abs().max().item(),
                grads=[
                    (x.grad / LAYERS - leaf.grad[local]).abs().max().item()
                    for x, leaf in zip(mine, leaves, strict=True)
                ],
                built=MASKS.built - built,
                host_bytes=MASKS.host_bytes - host,
                tile=layout.tile,
                row_mask_made=(len(local), tokens) in shapes.seen,
            )
        )
    return results


def learner_runs(rank: int, world_size: int, hf_dir: str, config: dict, batch) -> dict:
    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    state.initialize(ParallelConfig(context=2), seed=0)
    results = {"attention": attention_at_cp2(rank)}
    spec = load_hf_config(config)
    for name, kwargs, pack in LAYOUTS:
        parallel = ParallelConfig(**kwargs)
        state.initialize(parallel, seed=0)
        learner_config = LearnerConfig(
            params_dtype="float32",
            micro_batch_tokens=BUDGET // parallel.context,
            lr=1.0,
            adam_eps=1.0,
            clip_grad=0.0,
            pack_sequences=pack,
            flash_reinforce=FlashReinforceConfig(delta=2e-3),
        )
        learner = Learner(
            spec, parallel, learner_config, total_steps=1, init_hf_dir=hf_dir, spec_kind="torch"
        )
        log_probs = learner.policy_log_probs(batch)
        metrics = learner.train_step(batch)
        weights = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
        results[name] = (metrics, log_probs, weights)
    return results


@pytest.mark.distributed
def test_chunked_cp_attention_is_causal_attention_per_sequence(tmp_path):
    from tiny_qwen import tiny_checkpoint

    config, *_ = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=3)
    assert config["num_attention_heads"] != config["num_key_value_heads"]  # GQA
    per_rank = run_on_ranks(
        learner_runs, 2, str(tmp_path / "hf"), config, long_tailed_batch(), timeout_s=900
    )
    for rank, results in enumerate(per_rank):
        for (boundaries, rows), found in zip(ROWS, results["attention"], strict=True):
            where = f"rank {rank}, row {boundaries} x {rows}"
            assert found["output"] <= 1e-10, where
            assert max(found["grads"]) <= 1e-10, where
            # one shared lower-right tile (float64 here) for all three layers, no row mask
            assert found["built"] == 1, where
            rows_, cols = found["tile"]
            assert found["host_bytes"] == rows_ * cols * 8, where
            assert not found["row_mask_made"], where
        reference_metrics, reference_log_probs, reference_weights = results[LAYOUTS[0][0]]
        assert reference_metrics["grad_norm"] > 0
        for name, *_ in LAYOUTS[1:]:
            where = f"rank {rank}, {name}"
            metrics, log_probs, weights = results[name]
            assert per_rank[1 - rank][name][0] == metrics, f"{where}: ranks disagree"
            assert metrics["loss"] == pytest.approx(reference_metrics["loss"], abs=TOLERANCE)
            assert metrics["grad_norm"] == pytest.approx(
                reference_metrics["grad_norm"], rel=TOLERANCE
            ), where
            for ours, theirs in zip(log_probs, reference_log_probs, strict=True):
                assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=TOLERANCE)
            assert weights.keys() == reference_weights.keys(), where
            for key, value in weights.items():
                difference = (value - reference_weights[key]).abs().max().item()
                assert difference <= TOLERANCE, f"{where}: {key} differs by {difference}"
