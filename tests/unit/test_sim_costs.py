"""The run simulator's cost formulas against independent counts: torch's FLOP counter on
transformers' own models, the parameter counts on the Qwen model cards, and the lengths file
reader's errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_qwen import TINY
from torch.utils.flop_counter import FlopCounterMode

from megatron_fr.models.hf_config import load_hf_config
from megatron_fr.sim.config import LengthSettings, SyncSettings
from megatron_fr.sim.costs import active_params_per_token, sync_seconds, training_flops
from megatron_fr.sim.lengths import LognormalLengths, read_lengths


def tiny_model(model_type: str):
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[model_type](**TINY[model_type])
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    return model.eval(), config.to_dict() | {"model_type": model_type}


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_training_flops_match_torch_flop_counter(model_type):
    """torch counts the forward's matmuls (the experts a token is routed to, through
    transformers' eager expert loop) and the full S x S attention square; causal attention
    does half of that square, so 3 x counted = training_flops + the masked half, 6 L q S^2."""
    model, config = tiny_model(model_type)
    spec = load_hf_config(config)
    length = 24
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, spec.vocab_size, (1, length)))
    masked_half = 6 * spec.num_layers * spec.num_attention_heads * spec.head_dim * length**2
    assert 3 * counter.get_total_flops() == training_flops(spec, [length]) + masked_half


def test_active_parameters_match_the_model_cards():
    """Qwen3-30B-A3B: "Number of Activated Parameters: 3.3B" (counting the input
    embedding); Qwen3-8B: "Number of Parameters (Non-Embedding): 6.95B"."""
    moe = load_hf_config("qwen3-30b-a3b")
    with_embedding = active_params_per_token(moe) + moe.vocab_size * moe.hidden_size
    assert with_embedding / 1e9 == pytest.approx(3.3, rel=0.02)  # 3.35: the card keeps 2 digits
    dense = load_hf_config("qwen3-8b")
    non_embedding = active_params_per_token(dense) - dense.vocab_size * dense.hidden_size
    assert round(non_embedding / 1e9, 2) == 6.95


def test_sync_sends_the_model_in_bf16(tmp_path):
    model, config = tiny_model("qwen2")  # tied embeddings: one tensor, counted once
    (tmp_path / "config.json").write_text(json.dumps(config))
    parameters = sum(p.numel() for p in model.parameters())
    seconds = sync_seconds(SyncSettings(bandwidth_gb_s=1.0, latency_s=0.5), str(tmp_path))
    assert seconds == pytest.approx(0.5 + 2 * parameters / 1e9)
    given = SyncSettings(bandwidth_gb_s=4.0, latency_s=0.0, bytes=8 * 10**9)
    assert sync_seconds(given, str(tmp_path)) == pytest.approx(2.0)


def test_lognormal_lengths_median_tail_and_cap():
    settings = LengthSettings(median_tokens=1000, sigma=1.0, max_new_tokens=5000, prompt_tokens=7)
    sampler = LognormalLengths(settings, seed=3)
    draws = [sampler.draw() for _ in range(20000)]
    responses = np.array([d.response_tokens for d in draws])
    assert {d.prompt_tokens for d in draws} == {7}
    assert np.median(responses) == pytest.approx(1000, rel=0.05)
    assert responses.max() == 5000  # P(Z > ln 5) ~ 5.4 %: the cap is reached and held
    assert np.mean(responses == 5000) == pytest.approx(0.054, abs=0.01)
    again = LognormalLengths(settings, seed=3)
    assert [again.draw() for _ in range(5)] == draws[:5]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", r"lengths.jsonl:2: not JSON"),
        ("[3]", r"lengths.jsonl:2: expected an object"),
        ('{"prompt_tokens": 3}', r"lengths.jsonl:2: response_tokens must be an int >= 1, got None"),
        ('{"response_tokens": 5, "prompt_tokens": -1}', r"lengths.jsonl:2: prompt_tokens must"),
        ('{"response_tokens": true}', r"lengths.jsonl:2: response_tokens must be an int"),
    ],
)
def test_lengths_file_errors_name_the_line(tmp_path, line, message):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"response_tokens": 12, "prompt_tokens": 4}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        read_lengths(path, default_prompt_tokens=0)


def test_lengths_file_reads_prompt_default(tmp_path):
    path = tmp_path / "lengths.jsonl"
    path.write_text('{"response_tokens": 12, "prompt_tokens": 4}\n\n{"response_tokens": 3}\n')
    assert [(x.prompt_tokens, x.response_tokens) for x in read_lengths(path, 9)] == [
        (4, 12),
        (9, 3),
    ]
