"""Activation recompute (learner.recompute) changes what is kept for the backward pass, not the
step: on 2 gloo ranks, a tiny Qwen3-MoE learner takes one step from the same weights with
recompute none, selective and full, at EP2 (several micro-batches), TP2 + SP and PP2 (1F1B:
later micro-batches' forwards run before earlier ones are recomputed). Loss, acceptance,
gradient norm and every updated weight must be the same across the three settings (on the
CPU recomputation repeats the same operations: bit for bit), and the layers
must really have run again: forward hooks count each decoder layer's calls (full: twice per
micro-batch) and each MoE router's, inside the MoE block (selective and full: twice).
    .venv/bin/python -m pytest tests/distributed/test_recompute.py -q
"""

from __future__ import annotations

import pytest
import torch
from test_learner import random_batch
from tiny_qwen import TINY

from megatron_fr.parallel.spawn import run_on_ranks

CONFIG = dict(TINY["qwen3_moe"], router_aux_loss_coef=0.0)
LAYOUTS = [  # (ParallelConfig kwargs, per-rank token budget)
    (dict(expert=2), 20),
    (dict(tensor=2, sequence_parallel=True), 10_000),
    (dict(pipeline=2), 40),
]
MODES = ("none", "selective", "full")


def count_calls(module) -> dict[str, int]:
    """Forward calls of the decoder layers and of their MoE routers, counted as they happen."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_layer import TransformerLayer

    counts = {"layer": 0, "moe": 0}

    def hook(kind):
        def count(*_args):
            counts[kind] += 1

        return count

    for sub in module.modules():
        if isinstance(sub, TransformerLayer):
            sub.register_forward_hook(hook("layer"))
        elif isinstance(sub, TopKRouter):
            sub.register_forward_hook(hook("moe"))
    return counts


def steps(rank: int, world_size: int, hf_dir: str):
    from megatron_fr.config import FlashReinforceConfig, LearnerConfig, ParallelConfig
    from megatron_fr.learner.trainer import Learner
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    spec = load_hf_config(dict(CONFIG, model_type="qwen3_moe"))
    results = []
    for kwargs, budget in LAYOUTS:
        parallel = ParallelConfig(**kwargs)
        for mode in MODES:
            state.initialize(parallel, seed=0)
            config = LearnerConfig(
                params_dtype="float32",
                micro_batch_tokens=budget,
                lr=1e-3,
                recompute=mode,
                flash_reinforce=FlashReinforceConfig(delta=1e-3),
            )
            learner = Learner(spec, parallel, config, total_steps=2, init_hf_dir=hf_dir)
            counts = count_calls(learner.module)
            batch = random_batch()
            micros = len(learner._micro_batches(learner.plan(batch), batch, 0, None))
            metrics = learner.train_step(batch)
            weights = {n: p.detach().clone() for n, p in learner.module.named_parameters()}
            results.append((kwargs, mode, micros, dict(counts), metrics, weights))
    return results


@pytest.mark.distributed
def test_recompute_settings_give_the_same_step(tmp_path):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**CONFIG)).save_pretrained(
        tmp_path / "hf"
    )
    per_rank = run_on_ranks(steps, 2, str(tmp_path / "hf"), timeout_s=900)
    for results in per_rank:
        by_layout: dict[str, list] = {}
        for kwargs, mode, micros, counts, metrics, weights in results:
            by_layout.setdefault(str(kwargs), []).append((mode, micros, counts, metrics, weights))
        for layout, runs in by_layout.items():
            (_, micros, base_counts, base, base_weights), *others = runs
            layers = base_counts["layer"]
            assert layers > 0 and base_counts["moe"] == layers, layout
            for mode, _, counts, metrics, weights in others:
                where = f"{layout} recompute={mode}"
                assert counts["moe"] == 2 * layers, f"{where}: MoE blocks not recomputed"
                expected_layers = 2 * layers if mode == "full" else layers
                assert counts["layer"] == expected_layers, f"{where}: {counts}"
                for key in ("loss", "acceptance_rate", "grad_norm", "admitted"):
                    assert metrics[key] == base[key], f"{where}: {key}"
                for name, value in weights.items():
                    assert torch.equal(value, base_weights[name]), f"{where}: {name} differs"
    assert any(r[2] > 1 for r in per_rank[0]), "some layout should run several micro-batches"
