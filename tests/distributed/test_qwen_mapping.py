"""The Qwen mapping against transformers: round trip HF -> megatron -> HF is bitwise, and the
megatron model loaded through it computes the HF model's logits (TP1, fp32)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_fr.convert.qwen import hf_to_megatron, megatron_to_hf
from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.parallel.spawn import run_on_ranks

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
TINY = {
    "qwen3_moe": dict(
        COMMON,
        head_dim=16,
        rope_theta=1e6,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
    "qwen3": dict(COMMON, head_dim=16, rope_theta=1e6),
    "qwen2": dict(COMMON, rope_theta=1e4, tie_word_embeddings=True),
}


def tiny_checkpoint(model_type: str, directory) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """(config dict, HF tensors as saved, tokens, HF logits) of a random tiny model."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**TINY[model_type])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        logits = model(tokens).logits
    config_dict = config.to_dict() | {"model_type": model_type}
    return config_dict, load_file(f"{directory}/model.safetensors"), tokens, logits


def megatron_logits(rank: int, world_size: int, config: dict, tensors: dict, tokens):
    from megatron_fr.config import ParallelConfig
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.parallel import state

    state.initialize(ParallelConfig(), seed=0)
    spec = load_hf_config(config)
    model = build_gpt_model(spec, ParallelConfig(), params_dtype=torch.float32).eval()
    parameters = dict(model.named_parameters())
    assert parameters.keys() == tensors.keys(), parameters.keys() ^ tensors.keys()
    with torch.no_grad():
        for name, parameter in parameters.items():
            parameter.copy_(tensors[name])
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        return model(tokens, positions, attention_mask=None)


@pytest.mark.distributed
def test_round_trip_is_bitwise_and_logits_match_transformers(tmp_path):
    cases = {}
    for model_type in TINY:
        config, hf, tokens, logits = tiny_checkpoint(model_type, tmp_path / model_type)
        spec = load_hf_config(config)
        megatron = hf_to_megatron(spec, hf)
        back = megatron_to_hf(spec, megatron)
        assert back.keys() == hf.keys(), model_type
        for name, tensor in hf.items():
            assert torch.equal(back[name], tensor), f"{model_type}: {name} changed"
        cases[model_type] = (config, megatron, tokens, logits)
    for model_type, (config, megatron, tokens, logits) in cases.items():
        ours = run_on_ranks(megatron_logits, 1, config, megatron, tokens)[0]
        assert (ours - logits).abs().max() <= 1e-4, f"{model_type}: max |dlogit| too large"


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    config, hf, _, _ = tiny_checkpoint("qwen3", tmp_path)
    spec = load_hf_config(config)
    hf.pop("model.layers.1.self_attn.k_proj.weight")
    hf["model.layers.9.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.self_attn.k_proj.weight'\]"):
        hf_to_megatron(spec, hf)
