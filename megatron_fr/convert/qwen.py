"""HF <-> megatron tensor mapping for Qwen2, Qwen3 and Qwen3-MoE (unsharded tensors).

One layer at a time, so a converter can stream a checkpoint with bounded memory. Names follow
HF checkpoints (what save_pretrained writes: per-expert keys) and megatron's GPTModel with
either layer spec. Layout facts:
  - linear_qkv fuses q/k/v per query group: [groups, (heads_per_group + 2) * head_dim, hidden],
    each group holding its q heads, then its k head, then its v head (biases alike);
  - linear_fc1 = cat([gate_proj, up_proj], dim 0);
  - experts are global here; EP sharding (global = ep_rank * local_count + local) is applied by
    whoever shards the model, not by the name mapping.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import Tensor

from megatron_fr.models.hf_config import HFModelSpec

Tensors = dict[str, Tensor]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_GROUPED_EXPERT = re.compile(r"\.experts\.linear_fc[12]\.weight\d+$")


@dataclass(frozen=True)
class MegatronNames:
    """Where a layer's tensors live in megatron, which depends on the layer spec: TE fuses the
    norms into the following linears (fused_norms); TE's and the torch spec's grouped experts
    name expert e's weights linear_fc1.weight{e} (grouped_experts), the local spec's
    sequential ones local_experts.{e}.linear_fc1.weight."""

    fused_norms: bool = False
    grouped_experts: bool = False

    @classmethod
    def of(cls, parameter_names: Iterable[str]) -> MegatronNames:
        """The naming a built model uses, from its parameter names."""
        names = list(parameter_names)
        return cls(
            fused_norms=any(".linear_qkv.layer_norm_weight" in n for n in names),
            grouped_experts=any(_GROUPED_EXPERT.search(n) for n in names),
        )

    def input_norm(self, layer: str) -> str:
        if self.fused_norms:
            return f"{layer}.self_attention.linear_qkv.layer_norm_weight"
        return f"{layer}.input_layernorm.weight"

    def pre_mlp_norm(self, layer: str, moe: bool) -> str:
        if self.fused_norms and not moe:
            return f"{layer}.mlp.linear_fc1.layer_norm_weight"
        return f"{layer}.pre_mlp_layernorm.weight"

    def expert(self, layer: str, expert: int, linear: str) -> str:
        if self.grouped_experts:
            return f"{layer}.mlp.experts.{linear}.weight{expert}"
        return f"{layer}.mlp.experts.local_experts.{expert}.{linear}.weight"


def fuse_qkv(spec: HFModelSpec, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """HF q/k/v (weights [out, hidden] or biases [out]) -> megatron's grouped linear_qkv."""
    groups, head_dim = spec.num_key_value_heads, spec.head_dim
    per_group = spec.num_attention_heads // groups
    rest = q.shape[1:]
    parts = (
        q.reshape(groups, per_group * head_dim, *rest),
        k.reshape(groups, head_dim, *rest),
        v.reshape(groups, head_dim, *rest),
    )
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(spec: HFModelSpec, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    groups, head_dim = spec.num_key_value_heads, spec.head_dim
    per_group = spec.num_attention_heads // groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * head_dim, *rest)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


@functools.cache
def _one_to_one(spec: HFModelSpec, names: MegatronNames, index: int) -> Mapping[str, str]:
    """megatron name -> HF name for a layer's tensors that map without reshaping.

    Cached, read-only: weight sync maps a MoE model tensor by tensor, and a MoE layer's table
    names every expert (Qwen3-30B-A3B: 128 per layer, 12288 expert tensors per sync)."""
    layer, hf = f"decoder.layers.{index}", f"model.layers.{index}"
    pairs = {
        names.input_norm(layer): f"{hf}.input_layernorm.weight",
        names.pre_mlp_norm(layer, spec.is_moe): f"{hf}.post_attention_layernorm.weight",
        f"{layer}.self_attention.linear_proj.weight": f"{hf}.self_attn.o_proj.weight",
    }
    if spec.qk_layernorm:
        pairs[f"{layer}.self_attention.q_layernorm.weight"] = f"{hf}.self_attn.q_norm.weight"
        pairs[f"{layer}.self_attention.k_layernorm.weight"] = f"{hf}.self_attn.k_norm.weight"
    if spec.is_moe:
        pairs[f"{layer}.mlp.router.weight"] = f"{hf}.mlp.gate.weight"
        for e in range(spec.num_experts):
            pairs[names.expert(layer, e, "linear_fc2")] = f"{hf}.mlp.experts.{e}.down_proj.weight"
    else:
        pairs[f"{layer}.mlp.linear_fc2.weight"] = f"{hf}.mlp.down_proj.weight"
    return MappingProxyType(pairs)


@functools.cache
def _fc1_pairs(spec: HFModelSpec, names: MegatronNames, index: int) -> Mapping[str, str]:
    """megatron linear_fc1 name -> HF prefix whose gate_proj/up_proj it fuses (cached, as
    _one_to_one)."""
    layer, hf = f"decoder.layers.{index}", f"model.layers.{index}"
    if not spec.is_moe:
        return MappingProxyType({f"{layer}.mlp.linear_fc1.weight": f"{hf}.mlp"})
    return MappingProxyType(
        {
            names.expert(layer, e, "linear_fc1"): f"{hf}.mlp.experts.{e}"
            for e in range(spec.num_experts)
        }
    )


@dataclass(frozen=True)
class HFRows:
    """Rows [start, start + count) of HF tensor `name` (elements, for a 1-D tensor); count
    None means all of it."""

    name: str
    start: int = 0
    count: int | None = None


def _qkv_rows(spec: HFModelSpec, pattern: str) -> list[HFRows]:
    """fuse_qkv as row ranges: per query group, its q heads, then its k head, then its v head."""
    head_dim = spec.head_dim
    q_rows = spec.num_attention_heads // spec.num_key_value_heads * head_dim
    rows = []
    for group in range(spec.num_key_value_heads):
        rows.append(HFRows(pattern.format("q"), group * q_rows, q_rows))
        rows += [HFRows(pattern.format(p), group * head_dim, head_dim) for p in "kv"]
    return rows


def hf_row_sources(
    spec: HFModelSpec, name: str, names: MegatronNames = MegatronNames()
) -> list[HFRows]:
    """The full (TP1) megatron tensor `name` (global layer and expert indices) as the
    concatenation, along dim 0, of these HF row ranges.

    The same layout as layer_hf_to_megatron, stated as ranges, so a rank can read any shard
    of a fused tensor (a few query groups of linear_qkv, the matching halves of gate and up
    in linear_fc1) without building the whole tensor. A tied output layer (on the last
    pipeline stage) reads the embedding.
    """
    if name == "output_layer.weight" and spec.tie_word_embeddings:
        return [HFRows("model.embed_tokens.weight")]
    match = _LAYER.match(name)
    if match is None:
        pairs = outer_pairs(spec)
        if name not in pairs:
            raise KeyError(f"{name}: not a tensor of this {spec.model_type} model")
        return [HFRows(pairs[name])]
    index = int(match.group(1))
    one_to_one = _one_to_one(spec, names, index)
    if name in one_to_one:
        return [HFRows(one_to_one[name])]
    attn, layer = f"model.layers.{index}.self_attn", f"decoder.layers.{index}.self_attention"
    for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
        if name == f"{layer}.linear_qkv.{kind}":
            return _qkv_rows(spec, f"{attn}.{{}}_proj.{kind}")
    prefix = _fc1_pairs(spec, names, index).get(name)
    if prefix is None:
        raise KeyError(f"{name}: not a tensor of this {spec.model_type} model")
    rows = spec.moe_intermediate_size if spec.is_moe else spec.intermediate_size
    return [HFRows(f"{prefix}.{part}_proj.weight", 0, rows) for part in ("gate", "up")]


def hf_layer_names(spec: HFModelSpec, index: int) -> list[str]:
    """Every HF tensor name of decoder layer `index` (what a layer-by-layer reader loads)."""
    hf = f"model.layers.{index}.self_attn"
    names = list(_one_to_one(spec, MegatronNames(), index).values())
    names += [f"{hf}.{p}_proj.weight" for p in "qkv"]
    if spec.qkv_bias:
        names += [f"{hf}.{p}_proj.bias" for p in "qkv"]
    for prefix in _fc1_pairs(spec, MegatronNames(), index).values():
        names += [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
    return names


def layer_hf_to_megatron(
    spec: HFModelSpec, hf: Tensors, index: int, names: MegatronNames = MegatronNames()
) -> Tensors:
    """One decoder layer: HF tensors (by HF name) -> megatron tensors (by megatron name)."""
    out = {mname: hf[hname] for mname, hname in _one_to_one(spec, names, index).items()}
    attn, layer = f"model.layers.{index}.self_attn", f"decoder.layers.{index}.self_attention"
    out[f"{layer}.linear_qkv.weight"] = fuse_qkv(
        spec, *(hf[f"{attn}.{p}_proj.weight"] for p in "qkv")
    )
    if spec.qkv_bias:
        out[f"{layer}.linear_qkv.bias"] = fuse_qkv(
            spec, *(hf[f"{attn}.{p}_proj.bias"] for p in "qkv")
        )
    for mname, prefix in _fc1_pairs(spec, names, index).items():
        out[mname] = torch.cat([hf[f"{prefix}.gate_proj.weight"], hf[f"{prefix}.up_proj.weight"]])
    return out


def megatron_tensor_to_hf(
    spec: HFModelSpec, name: str, tensor: Tensor, names: MegatronNames = MegatronNames()
) -> Tensors:
    """One megatron tensor (global layer and expert indices) -> the HF tensor(s) it holds.

    Each megatron tensor maps on its own (a fused QKV to q/k/v, an fc1 to gate/up), so weight
    sync can convert tensor by tensor with memory bounded by the largest one.
    """
    match = _LAYER.match(name)
    if match is None:
        pairs = outer_pairs(spec)
        if name not in pairs:
            raise KeyError(f"{name}: not a tensor of this {spec.model_type} model")
        return {pairs[name]: tensor}
    index = int(match.group(1))
    one_to_one = _one_to_one(spec, names, index)
    attn, layer = f"model.layers.{index}.self_attn", f"decoder.layers.{index}.self_attention"
    if name in one_to_one:
        return {one_to_one[name]: tensor}
    for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
        if name == f"{layer}.linear_qkv.{kind}":
            parts = split_qkv(spec, tensor)
            return {f"{attn}.{p}_proj.{kind}": t for p, t in zip("qkv", parts, strict=True)}
    prefix = _fc1_pairs(spec, names, index).get(name)
    if prefix is None:
        raise KeyError(f"{name}: not a tensor of this {spec.model_type} model")
    gate, up = tensor.chunk(2, dim=0)
    return {
        f"{prefix}.gate_proj.weight": gate.contiguous(),
        f"{prefix}.up_proj.weight": up.contiguous(),
    }


def megatron_layer_names(
    spec: HFModelSpec, index: int, names: MegatronNames = MegatronNames()
) -> list[str]:
    """Every megatron tensor name of decoder layer `index` (global expert indices)."""
    layer = f"decoder.layers.{index}.self_attention"
    qkv = [f"{layer}.linear_qkv.weight"] + ([f"{layer}.linear_qkv.bias"] if spec.qkv_bias else [])
    return [*_one_to_one(spec, names, index), *qkv, *_fc1_pairs(spec, names, index)]


def layer_megatron_to_hf(
    spec: HFModelSpec, meg: Tensors, index: int, names: MegatronNames = MegatronNames()
) -> Tensors:
    """One decoder layer: megatron tensors -> HF tensors, exactly as save_pretrained names them."""
    out = {}
    for name in megatron_layer_names(spec, index, names):
        out.update(megatron_tensor_to_hf(spec, name, meg[name], names))
    return out


def outer_pairs(spec: HFModelSpec) -> dict[str, str]:
    """megatron name -> HF name for the embedding, final norm and (untied) output layer."""
    pairs = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
    }
    if not spec.tie_word_embeddings:
        pairs["output_layer.weight"] = "lm_head.weight"
    return pairs


def hf_tensor_names(spec: HFModelSpec) -> set[str]:
    """Every tensor name of the HF checkpoint `spec` describes."""
    names = set(outer_pairs(spec).values())
    for index in range(spec.num_layers):
        names.update(hf_layer_names(spec, index))
    return names


def hf_to_megatron(
    spec: HFModelSpec, hf: Tensors, names: MegatronNames = MegatronNames()
) -> Tensors:
    """A whole (small) checkpoint; refuses missing or unexpected tensors by name."""
    expected = hf_tensor_names(spec)
    missing, extra = sorted(expected - hf.keys()), sorted(hf.keys() - expected)
    if missing or extra:
        raise ValueError(
            f"HF checkpoint does not match the config: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    out = {mname: hf[hname] for mname, hname in outer_pairs(spec).items()}
    for index in range(spec.num_layers):
        out.update(layer_hf_to_megatron(spec, hf, index, names))
    return out


def megatron_to_hf(
    spec: HFModelSpec, meg: Tensors, names: MegatronNames = MegatronNames()
) -> Tensors:
    out = {hname: meg[mname] for mname, hname in outer_pairs(spec).items()}
    for index in range(spec.num_layers):
        out.update(layer_megatron_to_hf(spec, meg, index, names))
    return out
