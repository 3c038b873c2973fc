"""megatron's transformer-engine GPT layer spec, built where transformer-engine cannot be
installed, to see which checkpoint keys a TE-spec model reads and writes.

The spec is megatron's own: ``get_gpt_layer_with_transformer_engine_spec`` builds the
ModuleSpec tree (a fused layernorm-linear as linear_qkv and as the dense linear_fc1, a real
pre_mlp_layernorm only in MoE layers, TENorm for the q/k norms, the TE layer's
sharded_state_dict_keys_map), and megatron's TransformerLayer / MoELayer / SequentialMLP /
TransformerBlock / GPTModel turn it into sharded_state_dict keys. Only two things are answered
for the absent library: TESpecProvider's version checks ("recent"), and the leaves that are TE
modules, replaced by stand-ins that register the parameters TE's modules register (names from
transformer-engine's source, transformer_engine/pytorch/module/layernorm_linear.py, linear.py,
ops/basic/rmsnorm.py, ops/op.py) and shard them as megatron's TE wrappers do
(megatron/core/extensions/transformer_engine.py):

  TELayerNormColumnParallelLinear  weight, layer_norm_weight (+ layer_norm_bias for LayerNorm),
                                   _extra_state; weight/bias split on dim 0, the norm replicated
                                   -> ColumnParallelLinear plus a layer_norm_weight
  TEColumn/RowParallelLinear       weight (+ bias), _extra_state: the keys and splits of
                                   megatron's ColumnParallelLinear / RowParallelLinear
  TENorm (te.pytorch.RMSNorm)      weight, _extra_state (TE ops define get_extra_state)
  TEDotProductAttention            nothing (empty unless the softmax is learnable)

The final norm is TENorm as well (TransformerBlock.LayerNormImpl when TE is present). MoE
experts: without TE's grouped linear, megatron's TE provider builds SequentialMLP over TE
linears; TEGroupedMLP (what a GPU node builds) writes the same keys, by megatron's design
("The sharded state dict is interchangable with SequentialMLP's", experts.py).
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import ExitStack
from unittest import mock

import torch

from megatron_fr.config import ParallelConfig
from megatron_fr.models.hf_config import HFModelSpec


def _layer_norm_linear_class():
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    class LayerNormColumnParallelLinear(ColumnParallelLinear):
        """TE's LayerNormLinear: the preceding norm's weight lives in the linear."""

        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_norm_weight = torch.nn.Parameter(
                torch.ones(input_size, dtype=config.params_dtype)
            )
            if config.normalization == "LayerNorm":
                self.layer_norm_bias = torch.nn.Parameter(
                    torch.zeros(input_size, dtype=config.params_dtype)
                )

    return LayerNormColumnParallelLinear


class Norm(torch.nn.Module):
    """te.pytorch.RMSNorm: a weight, and the FP8 extra state every TE op carries."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, has_residual: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        pass


def _stand_ins() -> list[tuple[object, object]]:
    from megatron.core.extensions import transformer_engine as te_modules
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return [
        (te_modules.TELayerNormColumnParallelLinear, _layer_norm_linear_class()),
        (te_modules.TEColumnParallelLinear, ColumnParallelLinear),
        (te_modules.TERowParallelLinear, RowParallelLinear),
        (te_modules.TEDotProductAttention, DotProductAttention),
        (te_modules.TENorm, Norm),
        (provider._TENormWithResidual, Norm),
    ]


def _replace(node, stand_ins):
    """The spec tree with every TE leaf swapped for its stand-in (ModuleSpecs, submodule
    dataclasses and functools.partial builders are walked)."""
    for original, stand_in in stand_ins:
        if node is original:
            return stand_in
    if isinstance(node, functools.partial):
        args = [_replace(a, stand_ins) for a in node.args]
        keywords = {k: _replace(v, stand_ins) for k, v in node.keywords.items()}
        return functools.partial(_replace(node.func, stand_ins), *args, **keywords)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        fields = {
            f.name: _replace(getattr(node, f.name), stand_ins)
            for f in dataclasses.fields(node)
            if f.init
        }
        return dataclasses.replace(node, **fields)
    return node


def te_layer_spec(spec: HFModelSpec):
    """megatron's TE layer spec for `spec` (as models/gpt.layer_spec asks for it on a GPU
    node), with stand-in leaves."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import gpt_layer_specs

    with (
        mock.patch.object(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider),
        mock.patch.object(provider, "is_te_min_version", lambda *args, **kwargs: True),
    ):
        layer = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts if spec.is_moe else None,
            moe_grouped_gemm=spec.is_moe,
            qk_layernorm=spec.qk_layernorm,
        )
    return _replace(layer, _stand_ins())


def build_te_spec_model(spec: HFModelSpec, parallel: ParallelConfig, dtype: torch.dtype):
    """models.gpt.build_gpt_model with the TE layer spec (stand-in leaves) and TE's final norm."""
    from megatron.core.transformer import transformer_block

    from megatron_fr.models import gpt

    layer = te_layer_spec(spec)
    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(gpt, "layer_spec", lambda *a, **k: layer))
        stack.enter_context(mock.patch.object(transformer_block, "LayerNormImpl", Norm))
        return gpt.build_gpt_model(spec, parallel, params_dtype=dtype, initialize=False)
