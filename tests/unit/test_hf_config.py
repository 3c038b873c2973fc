"""HF config.json parsing and the layout rules checked before megatron builds a model."""

from __future__ import annotations

import json

import pytest

from megatron_fr.config import ParallelConfig
from megatron_fr.models.hf_config import PRESET_DIR, load_hf_config, preset_names
from megatron_fr.models.layout import check_model_layout


def test_presets_ship_the_five_models():
    assert preset_names() == [
        "deepseek-r1-distill-qwen-1.5b",
        "qwen2.5-7b-instruct",
        "qwen2.5-math-1.5b",
        "qwen3-30b-a3b",
        "qwen3-8b",
    ]


def test_qwen3_30b_a3b_preset():
    spec = load_hf_config("qwen3-30b-a3b")
    assert (spec.num_layers, spec.hidden_size, spec.head_dim) == (48, 2048, 128)
    assert (spec.num_attention_heads, spec.num_key_value_heads) == (32, 4)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (128, 8, 768)
    assert spec.qk_layernorm and not spec.qkv_bias and not spec.tie_word_embeddings
    assert spec.rope_theta == 1e6 and spec.norm_topk_prob


def test_qwen2_family_has_qkv_bias_and_its_own_tying():
    math_model = load_hf_config("qwen2.5-math-1.5b")
    distill = load_hf_config("deepseek-r1-distill-qwen-1.5b")
    assert math_model.qkv_bias and not math_model.qk_layernorm and not math_model.is_moe
    assert math_model.tie_word_embeddings and not distill.tie_word_embeddings
    assert math_model.head_dim == 1536 // 12


def test_directory_and_dict_sources_agree(tmp_path):
    config = json.loads((PRESET_DIR / "qwen3-8b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_hf_config(tmp_path) == load_hf_config(config) == load_hf_config("qwen3-8b")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(model_type="llama"), "unsupported model_type 'llama'"),
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(mlp_only_layers=[0]), "mixed dense/MoE"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    config = json.loads((PRESET_DIR / "qwen3-30b-a3b.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        load_hf_config(config)


def test_missing_config_names_the_presets(tmp_path):
    with pytest.raises(FileNotFoundError, match="qwen3-30b-a3b"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (ParallelConfig(tensor=8), "does not divide the 4 query groups"),
        (ParallelConfig(expert=3), "does not divide the 128 experts"),
        (ParallelConfig(pipeline=5), "does not divide the 48 layers"),
    ],
)
def test_layouts_megatron_cannot_build_are_refused(parallel, message):
    with pytest.raises(ValueError, match=message):
        check_model_layout(load_hf_config("qwen3-30b-a3b"), parallel)


def test_expert_parallel_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match="dense model"):
        check_model_layout(load_hf_config("qwen3-8b"), ParallelConfig(expert=2))
