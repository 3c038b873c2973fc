"""The Qwen mapping against transformers: round trip HF -> megatron -> HF is bitwise, and the
megatron model loaded through it computes the HF model's logits (TP1, fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_qwen import TINY, tiny_checkpoint

from megatron_fr.convert.qwen import hf_row_sources, hf_to_megatron, megatron_to_hf
from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.parallel.spawn import run_on_ranks

LAYOUTS = {  # name -> (ParallelConfig kwargs, families it applies to)
    "tp1": (dict(), ("qwen3_moe", "qwen3", "qwen2")),
    "tp2": (dict(tensor=2), ("qwen3", "qwen2")),
    "tp2_sp": (dict(tensor=2, sequence_parallel=True), ("qwen3_moe",)),
    "ep2": (dict(expert=2), ("qwen3_moe",)),
    "tp2_ep2_sp": (dict(tensor=2, expert=2, sequence_parallel=True), ("qwen3_moe",)),
}


def megatron_logits(rank: int, world_size: int, cases: dict) -> dict:
    """Full-vocab logits of the converted model under every layout, on every rank."""
    from megatron_fr.config import ParallelConfig
    from megatron_fr.convert.shard import load_full_state
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.parallel import state

    results = {}
    for layout, (kwargs, families) in LAYOUTS.items():
        parallel = ParallelConfig(**kwargs)
        state.initialize(parallel, seed=0)
        for model_type in families:
            config, tensors, tokens = cases[model_type]
            spec = load_hf_config(config)
            model = build_gpt_model(spec, parallel, params_dtype=torch.float32).eval()
            load_full_state(model, tensors, spec.num_experts)
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            with torch.no_grad():
                logits = model(tokens, positions, attention_mask=None, runtime_gather_output=True)
            results[layout, model_type] = logits
    return results


@pytest.mark.distributed
def test_round_trip_is_bitwise_and_logits_match_transformers(tmp_path):
    cases, expected = {}, {}
    for model_type in TINY:
        config, hf, tokens, logits = tiny_checkpoint(model_type, tmp_path / model_type)
        spec = load_hf_config(config)
        megatron = hf_to_megatron(spec, hf)
        back = megatron_to_hf(spec, megatron)
        assert back.keys() == hf.keys(), model_type
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), f"{model_type}: {name} changed"
        cases[model_type] = (config, megatron, tokens)
        expected[model_type] = logits
    for rank_results in run_on_ranks(megatron_logits, 4, cases, timeout_s=600):
        assert len(rank_results) == 8
        for (layout, model_type), logits in rank_results.items():
            error = (logits - expected[model_type]).abs().max().item()
            assert error <= 1e-4, f"{model_type} at {layout}: max |dlogit| {error}"


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    config, hf, _, _ = tiny_checkpoint("qwen3", tmp_path)
    spec = load_hf_config(config)
    hf.pop("model.layers.1.self_attn.k_proj.weight")
    hf["model.layers.9.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.weight'\]"):
        hf_to_megatron(spec, hf)


def test_row_sources_concatenate_to_the_fused_tensors(tmp_path):
    """hf_row_sources (what each rank reads) states the same layout as layer_hf_to_megatron
    (what conversion builds): every megatron tensor, rebuilt from its HF row ranges, is equal."""
    for model_type in TINY:
        config, hf, _, _ = tiny_checkpoint(model_type, tmp_path / model_type)
        spec = load_hf_config(config)
        megatron = hf_to_megatron(spec, hf)
        for name, tensor in megatron.items():
            pieces = [
                hf[piece.name][
                    piece.start : None if piece.count is None else piece.start + piece.count
                ]
                for piece in hf_row_sources(spec, name)
            ]
            assert torch.equal(torch.cat(pieces), tensor), f"{model_type}: {name}"
        if spec.tie_word_embeddings:
            (tied,) = hf_row_sources(spec, "output_layer.weight")
            assert tied.name == "model.embed_tokens.weight"
