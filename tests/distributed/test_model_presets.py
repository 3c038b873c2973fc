"""Every shipped preset builds as a megatron GPTModel (on the meta device) with exactly the
total and active parameter counts of the HF model transformers builds from the same config."""

from __future__ import annotations

import pytest
import torch

from megatron_fr.models.gpt import parameter_counts
from megatron_fr.models.hf_config import PRESET_DIR, load_hf_config, preset_names
from megatron_fr.parallel.spawn import run_on_ranks


def megatron_counts(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    from megatron_fr.config import ParallelConfig
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.parallel import state

    state.initialize(ParallelConfig(), seed=None)
    counts = {}
    for name in preset_names():
        spec = load_hf_config(name)
        model = build_gpt_model(spec, ParallelConfig(), meta=True)
        assert all(p.is_meta for p in model.parameters())
        counts[name] = parameter_counts(model, spec.num_experts, spec.num_experts_per_tok)
    return counts


def hf_counts(name: str) -> tuple[int, int]:
    import json

    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    raw = json.loads((PRESET_DIR / f"{name}.json").read_text())
    config = CONFIG_MAPPING[raw["model_type"]](**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = load_hf_config(name)
    return parameter_counts(model, spec.num_experts, spec.num_experts_per_tok)


@pytest.mark.distributed
def test_preset_parameter_counts_match_transformers():
    ours = run_on_ranks(megatron_counts, 1, timeout_s=600)[0]
    for name in preset_names():
        assert ours[name] == hf_counts(name), name
    # Qwen3-30B-A3B: 30.5 B total; 3.35 B active per token (8 of 128 experts, embeddings in).
    assert ours["qwen3-30b-a3b"] == (30_532_122_624, 3_353_032_704)
