"""Hugging Face config.json -> one typed description of the architecture (no torch, no megatron).

Supported families: qwen3_moe (Qwen3-30B-A3B), qwen3 (dense Qwen3), qwen2 (Qwen2.5, R1-Distill).
Anything the megatron builder would silently get wrong (sliding-window attention, RoPE scaling,
mixed dense/MoE layer patterns) is refused here with the field named.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen3", "qwen2")
PRESET_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True, kw_only=True)
class HFModelSpec:
    """The fields of an HF config that decide the megatron model."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    num_experts: int = 0
    """0 for dense models."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def preset_names() -> list[str]:
    return sorted(path.stem for path in PRESET_DIR.glob("*.json"))


def load_hf_config(source: str | Path | dict[str, Any]) -> HFModelSpec:
    """From a preset name, a checkpoint directory, a config.json path, or its parsed dict."""
    return spec_from_dict(_read(source))


def _read(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    if isinstance(source, str) and source in preset_names():
        return json.loads((PRESET_DIR / f"{source}.json").read_text())
    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(
            f"no config.json at {source!r} (and it is not a preset: {', '.join(preset_names())})"
        )
    return json.loads(path.read_text())


def _refuse_unsupported(config: dict[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (full attention only)")
    if config.get("rope_scaling"):
        raise ValueError(f"rope_scaling={config['rope_scaling']!r} is not supported")
    if model_type == "qwen3_moe" and (
        config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1
    ):
        raise ValueError(
            "mixed dense/MoE layers (mlp_only_layers, decoder_sparse_step != 1) are not supported"
        )


_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)
_MOE_SIZES = ("num_experts_per_tok", "moe_intermediate_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "num_experts", "num_local_experts")


def _refuse_malformed(config: Any) -> None:
    """ValueError naming the field for what no model can be built from: a config that is not
    an object, a size that is missing, not an integer or not positive, heads that do not
    divide, more experts per token than experts."""
    if not isinstance(config, dict):
        raise ValueError(f"must be a JSON object, not {type(config).__name__}")
    required = _SIZES + (_MOE_SIZES if config.get("model_type") == "qwen3_moe" else ())
    for key in (*required, *_OPTIONAL_SIZES):
        value = config.get(key)
        if value is None and key in required:
            raise ValueError(f"no {key}")
        if value is not None and (type(value) is not int or value < 1):
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    eps = config.get("rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < 1:
        raise ValueError(f"rms_norm_eps must be a number in (0, 1), got {eps!r}")
    heads = config["num_attention_heads"]
    if heads % config.get("num_key_value_heads", heads):
        raise ValueError(
            f"num_key_value_heads ({config['num_key_value_heads']}) "
            f"must divide num_attention_heads ({heads})"
        )
    if not config.get("head_dim") and config["hidden_size"] % heads:
        raise ValueError(
            f"hidden_size ({config['hidden_size']}) is not a multiple "
            f"of num_attention_heads ({heads}) and head_dim is not given"
        )
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts and config.get("num_experts_per_tok", 0) > experts:
        raise ValueError(
            f"num_experts_per_tok ({config['num_experts_per_tok']}) exceeds num_experts ({experts})"
        )


def spec_from_dict(config: dict[str, Any]) -> HFModelSpec:
    _refuse_malformed(config)
    _refuse_unsupported(config)
    model_type = config["model_type"]
    heads = config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    spec = dict(
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rms_norm_eps=config["rms_norm_eps"],
        max_position_embeddings=config["max_position_embeddings"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Qwen3 has them only with attention_bias.
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
    )
    if model_type == "qwen3_moe":
        spec.update(
            num_experts=config.get("num_experts", config.get("num_local_experts")),
            num_experts_per_tok=config["num_experts_per_tok"],
            moe_intermediate_size=config["moe_intermediate_size"],
            norm_topk_prob=bool(config.get("norm_topk_prob", False)),
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.0),
        )
    return HFModelSpec(**spec)
