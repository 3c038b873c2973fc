"""HFModelSpec + ParallelConfig -> megatron TransformerConfig and GPTModel.

megatron's config is built from ours, never the other way. Three layer specs (model.spec):
  te     transformer-engine's (fused kernels, grouped GEMM, FP8-capable); needs TE and CUDA;
  torch  megatron's local spec with torch's fused attention and grouped GEMM experts
         (models/torch_spec.py): the fast path without TE;
  local  megatron's local spec (unfused attention, one expert at a time), packed rows and CP
         added (models/attention.py): the reference, and what the CPU demo runs.
Unset, the spec is te where TE imports, else torch on a GPU, else local (resolve_layer_spec),
so the same code builds the model on an H100 node and in CPU CI. All three save and load the
same checkpoints.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.models.hf_config import HFModelSpec
from megatron_fr.models.layout import check_model_layout

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec

LAYER_SPECS = ("te", "torch", "local")


def use_transformer_engine() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def resolve_layer_spec(name: str | None) -> str:
    """The layer spec a model is built with: `name` (model.spec), or unset: te where
    transformer-engine imports (with CUDA), else torch on a GPU, else local (on a CPU the
    reference spec, which the CPU demo's figures were measured with). ValueError for te
    without TE, naming the alternatives."""
    if name is None:
        if use_transformer_engine():
            return "te"
        return "torch" if torch.cuda.is_available() else "local"
    if name not in LAYER_SPECS:
        raise ValueError(f"model.spec {name!r} is not one of {', '.join(LAYER_SPECS)}")
    if name == "te" and not use_transformer_engine():
        raise ValueError(
            "model.spec te needs transformer-engine and a CUDA device, which this machine "
            "lacks; use model.spec torch (torch's fused kernels, no TE) or local"
        )
    return name


def transformer_config(
    spec: HFModelSpec,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.bfloat16,
    initialize: bool = True,
    on_cpu: bool = False,
    routing_replay: bool = False,
    recompute: str = "none",
    spec_kind: str = "local",
) -> TransformerConfig:
    """megatron TransformerConfig for `spec` under `parallel` (dropout off for RL fine-tuning).

    spec_kind: the resolved layer spec (te uses TE's grouped GEMM experts);
    on_cpu keeps the parameters in host memory even where CUDA is present (conversion tools);
    routing_replay gives every router megatron's RouterReplay (learner/routing_replay.py);
    recompute: LearnerConfig.recompute, as megatron's settings (recompute_settings).
    """
    if routing_replay and not spec.is_moe:
        raise ValueError(
            "learner.routing_replay needs a MoE model; this one is dense (no routed experts)"
        )
    from megatron.core.transformer import TransformerConfig

    check_model_layout(spec, parallel)
    moe: dict[str, object] = {}
    if spec.is_moe:
        moe = dict(
            num_moe_experts=spec.num_experts,
            moe_router_topk=spec.num_experts_per_tok,
            moe_ffn_hidden_size=spec.moe_intermediate_size,
            # HF: softmax over all experts, top-k, renormalised iff norm_topk_prob. megatron's
            # softmax over the top-k logits is that renormalised form; pre-softmax is the other.
            moe_router_pre_softmax=not spec.norm_topk_prob,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=spec.router_aux_loss_coef,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=spec_kind == "te",
            # megatron's fused (TE) top-k ignores replay: it stays off (its default) here
            moe_router_fusion=False,
            moe_enable_routing_replay=routing_replay,
        )
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_key_value_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert,
        expert_tensor_parallel_size=parallel.effective_expert_tensor,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu or not torch.cuda.is_available(),
        perform_initialization=initialize,
        **moe,
        **recompute_settings(recompute, spec.is_moe),
    )


def recompute_settings(mode: str, moe: bool) -> dict[str, object]:
    """megatron's TransformerConfig fields for LearnerConfig.recompute (its docstring)."""
    if mode == "none":
        return {}
    if mode == "full":
        return dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if mode == "selective":
        # megatron 0.19's "layernorm" and "moe_act" recompute (CheckpointWithoutOutput) read
        # transformer-engine's FP8 state even without FP8: without TE they raise NameError.
        return dict(recompute_granularity="selective", recompute_modules=["moe" if moe else "mlp"])
    raise ValueError(f"unknown recompute mode {mode!r}; known: none, selective, full")


def layer_spec(spec: HFModelSpec, spec_kind: str) -> ModuleSpec:
    """megatron's layer spec for `spec`: te, torch or local (module docstring)."""
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = spec.num_experts if spec.is_moe else None
    if spec_kind == "te":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=spec.is_moe, qk_layernorm=spec.qk_layernorm
        )
    local = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=spec.qk_layernorm
    )
    if spec_kind == "torch":
        from megatron_fr.models.torch_spec import torch_layer_spec

        return _with_te_checkpoint_keys(torch_layer_spec(local, spec.is_moe), spec.is_moe)
    return _with_te_checkpoint_keys(_with_packed_attention(local), spec.is_moe)


def _with_packed_attention(local_spec: ModuleSpec) -> ModuleSpec:
    """The local spec with the core attention that takes packed rows and CP
    (models/attention.py) in place of megatron's DotProductAttention."""
    from megatron_fr.models.attention import PackedDotProductAttention

    attention = local_spec.submodules.self_attention
    inner = dataclasses.replace(attention.submodules, core_attention=PackedDotProductAttention)
    submodules = dataclasses.replace(
        local_spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)
    )
    return dataclasses.replace(local_spec, submodules=submodules)


def _with_te_checkpoint_keys(local_spec: ModuleSpec, moe: bool) -> ModuleSpec:
    """The local spec, saving and loading under the key names the TE spec uses.

    megatron's local spec maps its separate norms onto the keys of TE's fused
    layernorm-linears (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``,
    ``pre_mlp_layernorm.`` -> ``mlp.linear_fc1.layer_norm_``), which is right for dense
    layers. A TE-spec MoE layer has no fused linear_fc1: it keeps a real pre_mlp_layernorm
    (``pre_mlp_layernorm.weight``), so for MoE that second mapping is dropped; otherwise a
    checkpoint converted on CPU would not load into the TE model (strict loading).
    """
    if not moe:
        return local_spec
    keys_map = dict(local_spec.submodules.sharded_state_dict_keys_map)
    keys_map.pop("pre_mlp_layernorm.")
    submodules = dataclasses.replace(local_spec.submodules, sharded_state_dict_keys_map=keys_map)
    return dataclasses.replace(local_spec, submodules=submodules)


def build_gpt_model(
    spec: HFModelSpec,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.bfloat16,
    meta: bool = False,
    initialize: bool = True,
    on_cpu: bool = False,
    routing_replay: bool = False,
    recompute: str = "none",
    pg_collection: ProcessGroupCollection | None = None,
    spec_kind: str | None = None,
) -> GPTModel:
    """This rank's GPTModel stage.

    meta=True allocates nothing (parameter counts, planning); initialize=False allocates
    without random init (the weights are about to be loaded); on_cpu=True builds the local-spec
    model in host memory even on a GPU node (checkpoint conversion); routing_replay as in
    transformer_config, and recompute; pg_collection: the process groups the model uses
    (megatron's ProcessGroupCollection; None: those of parallel_state); spec_kind: model.spec
    (resolve_layer_spec; on_cpu builds the local spec).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg_collection = pg_collection or ProcessGroupCollection.use_mpu_process_groups()
    stage, stages = pg_collection.pp.rank(), pg_collection.pp.size()

    kind = "local" if on_cpu else resolve_layer_spec(spec_kind)
    config = transformer_config(
        spec,
        parallel,
        params_dtype=params_dtype,
        initialize=initialize and not meta,
        on_cpu=on_cpu,
        routing_replay=routing_replay,
        recompute=recompute,
        spec_kind=kind,
    )
    with torch.device("meta") if meta else nullcontext():
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec, kind),
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            pre_process=stage == 0,
            post_process=stage == stages - 1,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
            parallel_output=True,
            pg_collection=pg_collection,
        )
    if not meta and not config.use_cpu_initialization:
        # megatron allocates its own parallel layers on the GPU, but modules it takes from
        # torch (the local spec's norms) on the default device: move the rest, as megatron's
        # own training does after building a model.
        model.cuda(torch.cuda.current_device())
    _norms_in(model, params_dtype)
    return model


def _norms_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """The norms megatron takes from torch (the local and torch specs' WrappedTorchNorm)
    in the model's parameter dtype, as TE builds its own: torch builds them in float32,
    and torch.rms_norm with a bf16 input and a float32 weight takes its unfused path, which
    keeps float32 copies of every norm's input for the backward (4x a bf16 input: the
    rehearsal of launch/rehearsal.py measured it)."""
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm | torch.nn.LayerNorm):
            for param in module.parameters(recurse=False):
                param.data = param.data.to(dtype)  # in place: the Parameter stays the same


def parameter_counts(model: torch.nn.Module, num_experts: int, top_k: int) -> tuple[int, int]:
    """(total, active per token): expert parameters count top_k / num_experts of their size.

    Works on megatron and HF models alike: expert parameters are those named "experts".
    """
    total = expert = 0
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        if ".experts." in name:
            expert += parameter.numel()
    if num_experts == 0:
        return total, total
    return total, total - expert + expert * top_k // num_experts
