"""Checkpoints are portable between megatron's local layer spec (CPU conversion) and its
transformer-engine spec (GPU learners), for qwen3_moe, qwen3 and qwen2.

The TE-spec model is built from megatron's own TE spec function with stand-ins for the TE
leaf modules (tests/te_spec_standin.py says how and why that enumerates TE's keys). Shown:
the keys it asks for are exactly the converted checkpoint's, apart from the ``_extra_state``
of TE's norms, which local norms do not have; it loads the converted checkpoint and writes
back the same tensors under the same keys; a checkpoint it writes loads into the local-spec
model and computes transformers' logits; and a checkpoint in the older local MoE layout
(pre-MLP norm under mlp.linear_fc1.layer_norm_weight, which the TE spec does not read) still
loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_qwen import TINY, tiny_checkpoint

from megatron_fr.parallel.spawn import run_on_ranks

INPUT_NORM = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
DENSE_PRE_MLP_NORM = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
MOE_PRE_MLP_NORM = "decoder.layers.pre_mlp_layernorm.weight"


def te_only_objects(model_type: str) -> set[str]:
    """What TE has and the local spec lacks, written out: the FP8 extra state of TE's norms
    (the final norm, q/k norms where the model has them, the separate MoE pre-MLP norm)."""
    norms = ["decoder.final_layernorm"]
    if model_type in ("qwen3", "qwen3_moe"):
        norms += [
            "decoder.layers.self_attention.q_layernorm",
            "decoder.layers.self_attention.k_layernorm",
        ]
    if model_type == "qwen3_moe":
        norms.append("decoder.layers.pre_mlp_layernorm")
    return {f"{norm}._extra_state" for norm in norms}


def checkpoint_keys(directory: str) -> tuple[dict[str, tuple], set[str]]:
    """({tensor key: (global shape, dtype)}, {object key}) from a dist checkpoint's metadata."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    tensors, objects = {}, set()
    for entry in load_sharded_metadata(directory).values():
        if entry.key == "common_state":
            continue  # megatron's own entry for the non-sharded part, not a model key
        if isinstance(entry, ShardedObject):
            objects.add(entry.key)
        else:
            tensors[entry.key] = (tuple(entry.global_shape), entry.dtype)
    return tensors, objects


def requested_keys(model) -> tuple[dict[str, tuple | None], set[str]]:
    """The keys a model asks dist_checkpointing for (a factory's shape is known once built)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    tensors, objects = {}, set()
    for entry in nested_values(model.sharded_state_dict()):
        if isinstance(entry, ShardedObject):
            objects.add(entry.key)
        else:
            shape = isinstance(entry, ShardedTensor) and (tuple(entry.global_shape), entry.dtype)
            tensors[entry.key] = shape or None
    return tensors, objects


def plain_tensors(directory: str) -> dict[str, torch.Tensor]:
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    return load_plain_tensors(directory)


def legacy_local_model(spec, parallel):
    """A local-spec model with megatron's unmodified keys map (the older MoE layout)."""
    from unittest import mock

    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_fr.models import gpt

    raw = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=spec.num_experts or None, qk_layernorm=spec.qk_layernorm
    )
    with mock.patch.object(gpt, "layer_spec", lambda *args, **kwargs: raw):
        return gpt.build_gpt_model(spec, parallel, params_dtype=torch.float32, initialize=False)


def across_specs(rank: int, world_size: int, root: str, cases: dict) -> dict:
    from megatron.core import dist_checkpointing
    from te_spec_standin import build_te_spec_model

    from megatron_fr.config import ParallelConfig
    from megatron_fr.convert.checkpoint import hf_to_megatron_checkpoint, load_megatron_checkpoint
    from megatron_fr.convert.parallel_load import load_hf_into_model
    from megatron_fr.convert.verify import pipeline_logits
    from megatron_fr.models.gpt import build_gpt_model
    from megatron_fr.models.hf_config import load_hf_config
    from megatron_fr.parallel import state

    parallel, out = ParallelConfig(), {}
    state.initialize(parallel, seed=0)
    for model_type, (config, tokens) in cases.items():
        spec, base = load_hf_config(config), Path(root) / model_type
        converted, te_saved, legacy = (f"{base}.{name}" for name in ("local", "te", "legacy"))
        hf_to_megatron_checkpoint(base, converted, progress=False)
        te_model = build_te_spec_model(spec, parallel, torch.float32)
        result = {"te_requests": requested_keys(te_model), "converted": checkpoint_keys(converted)}
        load_megatron_checkpoint(te_model, converted)  # local -> TE
        Path(te_saved).mkdir()
        dist_checkpointing.save(te_model.sharded_state_dict(), te_saved)
        result["te_saved"] = checkpoint_keys(te_saved)
        saved, source = plain_tensors(te_saved), plain_tensors(converted)
        result["same_content"] = saved.keys() == source.keys() and all(
            torch.equal(saved[key], source[key]) for key in source
        )
        local = build_gpt_model(spec, parallel, params_dtype=torch.float32, initialize=False)
        load_megatron_checkpoint(local, te_saved)  # TE -> local
        result["logits"] = pipeline_logits(local.eval(), tokens, parallel)
        if spec.is_moe:
            old = legacy_local_model(spec, parallel)
            load_hf_into_model(old, base, spec, progress=False)
            Path(legacy).mkdir()
            dist_checkpointing.save(old.sharded_state_dict(), legacy)
            result["legacy"] = checkpoint_keys(legacy)
            for model in (te_model, local):
                load_megatron_checkpoint(model, legacy)
            result["legacy_logits"] = pipeline_logits(local.eval(), tokens, parallel)
        out[model_type] = result
    return out


@pytest.mark.distributed
def test_checkpoints_load_across_local_and_te_layer_specs(tmp_path):
    cases, reference = {}, {}
    for model_type in TINY:
        config, _, tokens, logits = tiny_checkpoint(model_type, tmp_path / model_type)
        cases[model_type], reference[model_type] = (config, tokens), logits

    (results,) = run_on_ranks(across_specs, 1, str(tmp_path), cases, timeout_s=900)

    for model_type, result in results.items():
        te_tensors, te_objects = result["te_requests"]
        ckpt_tensors, ckpt_objects = result["converted"]
        # The TE spec's own layout, written out: the input norm fused into linear_qkv, the
        # pre-MLP norm fused into linear_fc1 for dense layers and a module of its own for MoE.
        moe = model_type == "qwen3_moe"
        assert (
            INPUT_NORM in te_tensors and "decoder.layers.input_layernorm.weight" not in te_tensors
        )
        assert (MOE_PRE_MLP_NORM in te_tensors) == moe and (DENSE_PRE_MLP_NORM in te_tensors) != moe
        # What the TE model asks for is what the converted checkpoint holds.
        assert te_tensors.keys() == ckpt_tensors.keys(), model_type
        for key, shape in te_tensors.items():
            assert shape is None or shape == ckpt_tensors[key], f"{model_type}: {key}"
        assert ckpt_objects <= te_objects and te_objects - ckpt_objects == te_only_objects(
            model_type
        )
        # ... and what it writes back is the same tensors under the same keys.
        assert result["te_saved"][0] == ckpt_tensors and result["same_content"], model_type
        error = (result["logits"] - reference[model_type]).abs().max().item()
        assert error <= 1e-4, f"{model_type}: TE-written checkpoint in the local model: {error}"
    legacy_tensors, _ = results["qwen3_moe"]["legacy"]
    assert DENSE_PRE_MLP_NORM in legacy_tensors and MOE_PRE_MLP_NORM not in legacy_tensors
    error = (results["qwen3_moe"]["legacy_logits"] - reference["qwen3_moe"]).abs().max().item()
    assert error <= 1e-4, f"older MoE layout: {error}"
