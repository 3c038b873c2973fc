"""Tiny random Qwen2 / Qwen3 / Qwen3-MoE models made with transformers, for the mapping and
conversion tests: non-trivial norms and biases, so a swapped or dropped tensor shows."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

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


def tiny_checkpoint(
    model_type: str, directory, max_shard_size: str | None = None, seed: int = 0
) -> tuple[dict, dict, torch.Tensor, torch.Tensor]:
    """(config dict, HF tensors as saved, tokens, HF logits) of a random tiny model saved by
    save_pretrained into `directory` (sharded with an index when max_shard_size is given)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = CONFIG_MAPPING[model_type](**TINY[model_type])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a swapped tensor shows
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(
        directory, **({"max_shard_size": max_shard_size} if max_shard_size else {})
    )
    tokens = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        logits = model(tokens).logits
    config_dict = config.to_dict() | {"model_type": model_type}
    return config_dict, saved_tensors(directory), tokens, logits


def saved_tensors(directory) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in `directory`, by name."""
    tensors = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def to_megatron_on_rank(rank: int, world_size: int, hf_dir: str, out: str) -> None:
    """For run_on_ranks(..., 1): convert an HF directory into a megatron dist checkpoint."""
    from megatron_fr.convert.checkpoint import hf_to_megatron_checkpoint

    hf_to_megatron_checkpoint(hf_dir, out, progress=False)
